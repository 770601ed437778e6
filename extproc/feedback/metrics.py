"""Sidecar-side feedback metrics, created in a caller-given registry (never the global one at import).

`register_feedback_metrics(registry)` returns a `FeedbackMetrics`; `FeedbackLoop` updates the feed and
controller series, the limiter calls `observe_budget` for the KV-token budget series.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from extproc.core.adaptive import ControllerState
from extproc.core.kv_budget import KvBudget


class FeedbackMetrics:
    """The gauges and counters of the KV feedback path, labelled by pool (served model name)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.kv_usage = Gauge(
            "extproc_kv_usage_ratio",
            "Aggregated KV-cache usage of the pool (0..1).",
            ["pool"],
            registry=registry,
        )
        self.requests_waiting = Gauge(
            "extproc_requests_waiting", "Requests waiting in the pool's servers.", ["pool"], registry=registry
        )
        self.scale = Gauge(
            "extproc_adaptive_scale_ratio",
            "Factor applied to the pool's base limits.",
            ["pool"],
            registry=registry,
        )
        self.stale = Gauge(
            "extproc_feed_stale", "1 when the pool has no fresh sample.", ["pool"], registry=registry
        )
        self.samples = Counter("extproc_feed_samples", "Feed samples received.", registry=registry)
        self.reconnects = Counter(
            "extproc_feed_reconnects",
            "Feed stream (re)connection attempts after a failure.",
            registry=registry,
        )
        self.capacity = Gauge(
            "extproc_kv_capacity_tokens", "KV capacity of the pool in tokens.", ["pool"], registry=registry
        )
        self.demand = Gauge(
            "extproc_kv_demand_tokens", "KV footprint admitted by this sidecar.", ["pool"], registry=registry
        )
        self.headroom = Gauge(
            "extproc_kv_headroom_tokens",
            "KV budget minus admitted demand (negative: over budget).",
            ["pool"],
            registry=registry,
        )

    def observe_state(self, pool: str, state: ControllerState, capacity_tokens: int | None) -> None:
        self.kv_usage.labels(pool).set(state.kv_usage if state.kv_usage is not None else float("nan"))
        self.requests_waiting.labels(pool).set(state.waiting)
        self.scale.labels(pool).set(state.scale)
        self.stale.labels(pool).set(1.0 if state.stale else 0.0)
        self.capacity.labels(pool).set(capacity_tokens if capacity_tokens is not None else 0)

    def observe_budget(self, pool: str, budget: KvBudget) -> None:
        self.demand.labels(pool).set(budget.demand_tokens)
        headroom = budget.headroom_tokens
        self.headroom.labels(pool).set(headroom if headroom is not None else float("nan"))


def register_feedback_metrics(registry: CollectorRegistry) -> FeedbackMetrics:
    """Create the feedback metrics in `registry` (call once per registry)."""
    return FeedbackMetrics(registry)
