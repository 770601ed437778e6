"""The KV budget's own series (`extproc_kv_*`), beside the budget: what it books, its corrections, its part
of the fleet's pool and its fair shares, labelled by pool. Created in a caller-given registry (never the
global one at import); the feed's metrics (`kvfeed/subscriber/metrics.py`) own one and the feed's runtime
updates it when a budget changes and at each sample. Prometheus objects are in-memory counters: nothing here
does I/O, the admin server exposes them.
"""

from __future__ import annotations

import contextlib

from prometheus_client import CollectorRegistry, Gauge

from extproc.core.kv.budget import KvBudget
from extproc.core.kv.fleet import Claim

ORDER_STATES = ("first", "behind")
"""`extproc_kv_fleet_order`'s states (`FleetOrder.first`, `FleetOrder.behind`)."""

TENANT_SERIES = 20
"""Tenants shown by name in `extproc_kv_attained_service_share`, per pool: those who received most lately;
the rest are summed as `other`, so the label set stays bounded however many tenants send."""


class KvBudgetMetrics:
    """The gauges of each pool's KV budget."""

    def __init__(self, registry: CollectorRegistry) -> None:
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
            "The engine correction at the last sample: KV in use this sidecar's leases did not account for "
            "(a pool of several engines read as full as its fullest), or (negative) what its settled leases "
            "were booked for beyond the KV in use.",
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
        self.capacity = Gauge(
            "extproc_kv_budget_capacity_tokens",
            "KV capacity in tokens of what the budget books against: its pool's engines, or one engine's "
            "where the budget is that engine's (pool <pool>@<ip:port>, behind a picker); NaN unknown.",
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
        self.claim = Gauge(
            "extproc_kv_fleet_claim",
            "1 for what this replica takes of the pool's free room now (state: full, its part; yielded, a "
            "sliver, quiet a while; asking, a sliver until the other replicas have heard it wants its part), "
            "0 for the other states. Only read where replicas share a store.",
            ["pool", "state"],
            registry=registry,
        )
        self.order = Gauge(
            "extproc_kv_fleet_order",
            "1 for where this replica's oldest request waiting for the pool's KV stands in the fleet (state: "
            "first, the fleet's oldest, heard by every other replica: it takes the free room but the others' "
            "slivers; behind, another replica's is older: a sliver), 0 for the other state; both 0 where "
            "nothing waits anywhere. Only read where replicas share a store.",
            ["pool", "state"],
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

    def forget(self, pool: str) -> None:
        """Remove every series of `pool` (a budget dropped: one engine's, gone from the feed)."""
        single = [self.demand, self.booked, self.unexplained, self.forecasting, self.shared, self.finished]
        single += [self.headroom, self.capacity, self.budget_tokens, self.peers_booked, self.peers_known]
        single += [self.fairness, self.claimed]
        for gauge in single:
            with contextlib.suppress(KeyError):
                gauge.remove(pool)
        for claim in Claim:
            with contextlib.suppress(KeyError):
                self.claim.remove(pool, claim.value)
        for state in ORDER_STATES:
            with contextlib.suppress(KeyError):
                self.order.remove(pool, state)
        for tenant in self._tenants_shown.pop(pool, set()):
            with contextlib.suppress(KeyError):
                self.attained.remove(pool, tenant)

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
        capacity = budget.capacity_tokens
        self.capacity.labels(pool).set(capacity if capacity is not None else float("nan"))
        allowed = budget.budget_tokens
        self.budget_tokens.labels(pool).set(allowed if allowed is not None else float("nan"))
        peers = budget.fleet.peers(now)
        self.peers_booked.labels(pool).set(peers.share.booked if peers is not None else 0)
        self.peers_known.labels(pool).set(1.0 if peers is not None else 0.0)
        for claim in Claim:
            held = budget.fleet.shared and budget.fleet.claim is claim
            self.claim.labels(pool, claim.value).set(1.0 if held else 0.0)
        order = budget.fleet.order
        for state, held in zip(ORDER_STATES, (order.first, order.behind), strict=True):
            self.order.labels(pool, state).set(1.0 if budget.fleet.shared and held else 0.0)
