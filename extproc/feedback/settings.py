"""Plain-data settings of the sidecar's feed subscriber, importable without any network library.

`extproc.config` builds a `SubscriberConfig` while loading the YAML file; keeping it here (and not beside
the gRPC/aiohttp code in `subscriber.py`) lets the config layer load and validate without importing I/O
packages.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from extproc.feed.targets import Target


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
            raise ValueError("subscriber.exporters: give exporters, a service name or direct targets")
        for addr in (*self.exporters, *([self.service] if self.service else [])):
            split_hostport(addr)
        if not 0 < self.backoff_initial <= self.backoff_max:
            raise ValueError("subscriber.backoff_initial: must be > 0 and <= backoff_max")
        if self.backoff_multiplier < 1:
            raise ValueError("subscriber.backoff_multiplier: must be >= 1")
        if not 0 <= self.backoff_jitter < 1:
            raise ValueError("subscriber.backoff_jitter: must be in [0, 1)")


def split_hostport(addr: str) -> tuple[str, int]:
    """`host:port` or `[v6]:port` as (host, port); raises ValueError naming the bad address."""
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"subscriber: expected host:port, got {addr!r}")
    return host.strip("[]"), int(port)
