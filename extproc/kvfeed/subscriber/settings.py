"""Plain-data settings of the sidecar's side of the feed, importable without any network library.

These are the runtime types the subscriber takes: `extproc.config` converts the YAML file's `feedback`,
`adaptive` and `kv_budget` sections into a `FeedbackConfig` (with its `SubscriberConfig`, and the budget's
`KvBudgetConfig`, which lives beside the budget in `extproc.core.kv.config`) while loading it,
and the schema's defaults are these classes' own. Keeping them here (and not beside the gRPC/aiohttp code
in `client.py`) lets the config layer load and validate without importing I/O packages, and this package
never imports the config's classes. A bad field raises `SubscriberConfigError`, whose `key` the config
loader puts under its own section (`feedback.exporters`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from extproc.core.engine.adaptive import AdaptiveConfig
from extproc.core.kv.config import KvBudgetConfig
from extproc.kvfeed.targets import Target

KvMode = Literal["max", "mean"]
"""How the KV usage of a pool's nodes is combined: the fullest node, or their mean."""


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


@dataclass(frozen=True)
class FeedbackConfig:
    """KV-cache feedback: where samples come from and how each pool's limits react to them."""

    subscriber: SubscriberConfig | None = None
    kv_aggregation: KvMode = "max"
    unserved_models: Literal["refuse", "admit"] = "refuse"  # names a listing engine does not serve
    adaptive_default: AdaptiveConfig = field(default_factory=AdaptiveConfig)
    adaptive_pools: Mapping[str, AdaptiveConfig] = field(default_factory=dict)
    kv_budget: KvBudgetConfig = field(default_factory=KvBudgetConfig)

    @property
    def enabled(self) -> bool:
        return self.subscriber is not None
