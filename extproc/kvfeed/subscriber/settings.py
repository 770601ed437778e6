"""Plain-data settings of the sidecar's feed subscriber, importable without any network library.

`extproc.config` builds a `SubscriberConfig` while loading the YAML file; keeping it here (and not beside
the gRPC/aiohttp code in `subscriber.py`) lets the config layer load and validate without importing I/O
packages. A bad field raises `SubscriberConfigError`, whose `key` the config loader puts under its own
section (`feedback.exporters`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from extproc.kvfeed.targets import Target


@dataclass(frozen=True, slots=True)
class SubscriberConfig:
    """Where to get samples from. At least one of `exporters`, `service`, `direct_targets`."""

    exporters: tuple[str, ...] = ()  # static host:port list
    service: str | None = None  # headless Service "name.ns.svc:50061", re-resolved
    resolve_interval: float = 10.0
    models: tuple[str, ...] = ()  # empty: all
    backoff_initial: float = 0.25
    backoff_max: float = 10.0
    backoff_multiplier: float = 2.0
    backoff_jitter: float = 0.5  # delay is scaled by a random factor in [1 - jitter, 1]
    idle_timeout: float = 15.0  # reconnect when a stream is silent this long (exporters send every second)
    direct_targets: tuple[Target, ...] = ()
    direct_node: str = "local"
    scrape_interval: float = 1.0
    scrape_timeout: float = 0.8
    forget_after: float = 300.0  # drop samples not refreshed for this long (departed endpoints)
    extra_channel_options: tuple[tuple[str, int | str], ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if not (self.exporters or self.service or self.direct_targets):
            raise SubscriberConfigError("exporters", "give exporters, a service name or direct targets")
        for key, addr in (*(("exporters", a) for a in self.exporters), ("service", self.service or "h:0")):
            if _hostport(addr) is None:
                raise SubscriberConfigError(key, f"expected host:port, got {addr!r}")
        if not 0 < self.backoff_initial <= self.backoff_max:
            raise SubscriberConfigError("backoff_initial", "must be > 0 and <= backoff_max")
        if self.backoff_multiplier < 1:
            raise SubscriberConfigError("backoff_multiplier", "must be >= 1")
        if not 0 <= self.backoff_jitter < 1:
            raise SubscriberConfigError("backoff_jitter", "must be in [0, 1)")


class SubscriberConfigError(ValueError):
    """A bad `SubscriberConfig` field: `key` names it, `reason` says why."""

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(f"subscriber.{key}: {reason}")
        self.key = key
        self.reason = reason


def _hostport(addr: str) -> tuple[str, int] | None:
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit():
        return None
    return host.strip("[]"), int(port)


def split_hostport(addr: str) -> tuple[str, int]:
    """`host:port` or `[v6]:port` as (host, port); raises ValueError naming the bad address."""
    parsed = _hostport(addr)
    if parsed is None:
        raise ValueError(f"subscriber: expected host:port, got {addr!r}")
    return parsed
