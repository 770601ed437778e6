"""Sidecar-side feedback metrics, created in a caller-given registry (never the global one at import).

`register_feedback_metrics(registry)` returns a `FeedbackMetrics`; `FeedbackLoop` updates the feed and
controller series, the limiter calls `observe_budget` for the KV-token budget series.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from extproc.core.engine.adaptive import ControllerState
from extproc.core.kv.budget import KvBudget

TENANT_SERIES = 20
"""Tenants shown by name in `extproc_kv_attained_service_share`, per pool: those who received most lately;
the rest are summed as `other`, so the label set stays bounded however many tenants send."""


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
            "extproc_adaptive_scale_ratio",
            "Factor applied to the pool's base limits.",
            ["pool"],
            registry=registry,
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
        self.capacity = Gauge(
            "extproc_kv_capacity_tokens", "KV capacity of the pool in tokens.", ["pool"], registry=registry
        )
        self.demand = Gauge(
            "extproc_kv_demand_tokens",
            "Lifetime KV footprint admitted by this sidecar (prompt + expected completion per lease).",
            ["pool"],
            registry=registry,
        )
        self.booked = Gauge(
            "extproc_kv_booked_tokens",
            "KV tokens the budget compares with its limit: the forecast peak of admitted requests plus "
            "unexplained engine KV, or the lifetime demand when not forecasting.",
            ["pool"],
            registry=registry,
        )
        self.unexplained = Gauge(
            "extproc_kv_unexplained_tokens",
            "The engine correction at the last sample: KV in use this sidecar's leases did not account for, "
            "or (negative) what its settled leases were booked for beyond the KV in use.",
            ["pool"],
            registry=registry,
        )
        self.forecasting = Gauge(
            "extproc_kv_forecasting",
            "1 when the KV budget books by forecast (fresh feed), 0 when it books whole lifetimes.",
            ["pool"],
            registry=registry,
        )
        self.shared = Gauge(
            "extproc_kv_shared_prompt_tokens",
            "Prompt tokens of admitted requests not booked because a request in flight holds the same prefix "
            "(booked once per replica, as the engine's prefix cache holds it).",
            ["pool"],
            registry=registry,
        )
        self.finished = Gauge(
            "extproc_kv_engine_finished_requests",
            "Admitted requests the engine has finished while their clients still read the answer (lean "
            "profile: the engine runs fewer sequences than the settled leases, nothing waits): booked "
            "nothing until the next feed sample, their slots held until Envoy's end report.",
            ["pool"],
            registry=registry,
        )
        self.headroom = Gauge(
            "extproc_kv_headroom_tokens",
            "KV budget minus booked tokens (negative: over budget).",
            ["pool"],
            registry=registry,
        )
        self._fleet_series(registry)
        self._fairness_series(registry)

    def _fleet_series(self, registry: CollectorRegistry) -> None:
        self.budget_tokens = Gauge(
            "extproc_kv_budget_tokens",
            "KV tokens this replica may book of the pool now: the pool's target less what the other replicas "
            "sharing the store have booked (at most capacity_share of it), or its fallback share while they "
            "are unknown (NaN: capacity unknown).",
            ["pool"],
            registry=registry,
        )
        self.peers_booked = Gauge(
            "extproc_kv_peers_booked_tokens",
            "KV tokens the other gateway replicas of the pool have booked, as the shared store last said "
            "(0 without a shared store or while it cannot be read).",
            ["pool"],
            registry=registry,
        )
        self.peers_known = Gauge(
            "extproc_kv_peers_known",
            "1 while the other replicas' KV figures of the pool are fresh from the shared store, 0 while "
            "this replica books on its fixed share (no shared store, or the store unreachable).",
            ["pool"],
            registry=registry,
        )

    def _fairness_series(self, registry: CollectorRegistry) -> None:
        self.fairness = Gauge(
            "extproc_kv_fairness_index",
            "Jain's index over the tenants' weighted KV service received lately (decayed admitted "
            "footprints): 1 when all received the same, 1/n when one of n received everything.",
            ["pool"],
            registry=registry,
        )
        self.attained = Gauge(
            "extproc_kv_attained_service_share",
            "Each tenant's share of the pool's weighted KV service received lately (the "
            f'{TENANT_SERIES} largest by name, the rest as tenant="other").',
            ["pool", "tenant"],
            registry=registry,
        )
        self.claimed = Gauge(
            "extproc_kv_claimed_tokens",
            "KV tokens a refused request claims from later requests of other tenants until it comes back "
            "(0: no claim).",
            ["pool"],
            registry=registry,
        )
        self._tenants_shown: dict[str, set[str]] = {}

    def observe_fairness(self, pool: str, budget: KvBudget, now: float) -> None:
        """The pool's fair-share series as of `now` (nothing without fair shares). Once per feed sample, not
        per booking change as `observe_budget`: it walks every tenant served lately."""
        fair = budget.fairness
        if fair is None:
            return
        self.fairness.labels(pool).set(fair.fairness_index(now))
        self.claimed.labels(pool).set(fair.claimed_tokens(now))
        shares = sorted(fair.shares(now).items(), key=lambda item: -item[1])
        shown = dict(shares[:TENANT_SERIES])
        rest = sum(share for _, share in shares[TENANT_SERIES:])
        if rest > 0:
            shown["other"] = shown.get("other", 0.0) + rest
        for gone in self._tenants_shown.get(pool, set()) - set(shown):
            self.attained.remove(pool, gone)
        for tenant, share in shown.items():
            self.attained.labels(pool, tenant).set(share)
        self._tenants_shown[pool] = set(shown)

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
        """The budget's gauges as of its last decision or engine sample (`now` says whether it forecasts)."""
        self.demand.labels(pool).set(budget.demand_tokens)
        self.booked.labels(pool).set(budget.booked_tokens)
        self.unexplained.labels(pool).set(budget.unexplained_tokens)
        self.shared.labels(pool).set(budget.shared_prompt_tokens)
        self.finished.labels(pool).set(budget.engine_finished)
        self.forecasting.labels(pool).set(1.0 if budget.forecasting(now) else 0.0)
        headroom = budget.headroom_tokens
        self.headroom.labels(pool).set(headroom if headroom is not None else float("nan"))
        allowed = budget.budget_tokens
        self.budget_tokens.labels(pool).set(allowed if allowed is not None else float("nan"))
        peers = budget.fleet.peers(now)
        self.peers_booked.labels(pool).set(peers.share.booked if peers is not None else 0)
        self.peers_known.labels(pool).set(1.0 if peers is not None else 0.0)


def register_feedback_metrics(registry: CollectorRegistry) -> FeedbackMetrics:
    """Create the feedback metrics in `registry` (call once per registry)."""
    return FeedbackMetrics(registry)
