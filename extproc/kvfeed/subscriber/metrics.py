"""Sidecar-side feedback metrics, created in a caller-given registry (never the global one at import).

`register_feedback_metrics(registry)` returns a `FeedbackMetrics`; `FeedbackLoop` updates the feed and
controller series, the KV budget's own series are `KvBudgetMetrics` (core/kv/metrics.py), which it owns.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from extproc.core.engine.adaptive import ControllerState
from extproc.core.kv.budget import KvBudget
from extproc.core.kv.metrics import KvBudgetMetrics


class FeedbackMetrics:
    """The gauges and counters of the KV feedback path, labelled by pool (served model name)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.decode_pace = Gauge(
            "extproc_feed_decode_tokens_per_second",
            "Decode pace per running sequence the pool's fresh engines publish (NaN: none): the rate an "
            "unreported request is charged at while the pool has none learned from its streams.",
            ["pool"],
            registry=registry,
        )
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
            "extproc_adaptive_scale_ratio", "Factor on the pool's base limits.", ["pool"], registry=registry
        )
        self.stale = Gauge(
            "extproc_feed_stale", "1 when the pool has no fresh sample.", ["pool"], registry=registry
        )
        self.engine_down = Gauge(
            "extproc_engine_down",
            "1 while the feed shows every endpoint of the pool refusing connections (past a 1 s grace): the "
            "sidecar refuses the pool's requests with 503 engine_down and holds its adaptive scale; 0 "
            "otherwise (a stale feed is extproc_feed_stale, not this).",
            ["pool"],
            registry=registry,
        )
        self.samples = Counter("extproc_feed_samples", "Feed samples received.", registry=registry)
        self.engine_rejections = Counter(
            "extproc_feed_engine_rejections",
            "Requests the pool's engines refused for want of queue room, from the growth of their counters "
            "in the feed (vLLM's vllm:admission_rejections_total): any gateway's requests, this one's "
            "included (those are also in extproc_engine_refusals_total). Each growth drops the pool's "
            "adaptive scale.",
            ["pool"],
            registry=registry,
        )
        self.invalid_samples = Counter(
            "extproc_feed_invalid_samples",
            "Feed samples refused for a reading no server can have (NaN, inf, negative, a capacity of 0 or "
            "above 2^40 tokens), by the field that held it; the endpoint counts as missing.",
            ["field"],
            registry=registry,
        )
        self.reconnects = Counter(
            "extproc_feed_reconnects",
            "Feed stream (re)connection attempts after a failure.",
            registry=registry,
        )
        self.sample_delay = _sample_delay(registry)
        self.capacity = Gauge(
            "extproc_kv_capacity_tokens", "KV capacity of the pool in tokens.", ["pool"], registry=registry
        )
        self.budget = KvBudgetMetrics(registry)

    def observe_state(
        self,
        pool: str,
        state: ControllerState,
        capacity_tokens: int | None,
        decode_tokens_per_second: float | None = None,
    ) -> None:
        pace = decode_tokens_per_second
        self.decode_pace.labels(pool).set(pace if pace is not None else float("nan"))
        self.kv_usage.labels(pool).set(state.kv_usage if state.kv_usage is not None else float("nan"))
        self.requests_waiting.labels(pool).set(state.waiting)
        self.scale.labels(pool).set(state.scale)
        self.stale.labels(pool).set(1.0 if state.stale else 0.0)
        self.engine_down.labels(pool).set(1.0 if state.engine_down else 0.0)
        self.capacity.labels(pool).set(capacity_tokens if capacity_tokens is not None else 0)

    def observe_budget(self, pool: str, budget: KvBudget, now: float | None = None) -> None:
        """The budget's gauges as of its last decision or engine sample (`KvBudgetMetrics`)."""
        self.budget.observe_budget(pool, budget, now)

    def forget_budget(self, pool: str) -> None:
        """Remove a budget's series (an engine's budget the feed forgot: `KvBudgetMetrics.forget`)."""
        self.budget.forget(pool)

    def observe_fairness(self, pool: str, budget: KvBudget, now: float) -> None:
        """The pool's fair-share series as of `now` (`KvBudgetMetrics`)."""
        self.budget.observe_fairness(pool, budget, now)


def register_feedback_metrics(registry: CollectorRegistry) -> FeedbackMetrics:
    """Create the feedback metrics in `registry` (call once per registry)."""
    return FeedbackMetrics(registry)


def _sample_delay(registry: CollectorRegistry) -> Histogram:
    """`extproc_feed_sample_delay_seconds` (`readtime.ReadTimes`)."""
    return Histogram(
        "extproc_feed_sample_delay_seconds",
        "How long after its exporter read the engine's page a sample arrived, beyond the endpoint's most "
        "timely recent one (the clocks' skew cancelled): the charge tally times the reading, not the "
        "arrival; seconds here mean a starved exporter, sidecar or network between them.",
        buckets=(0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0),
        registry=registry,
    )
