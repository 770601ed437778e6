"""Connects the KV feed to the sidecar's limits: adaptive scales, KV-token budgets and their metrics.

Each pool is a served model name. A pool's scale multiplies the base limits of its `model:<name>` key, so
an operator gives each model pool its own `limits.models.<name>` entry for the feedback to act on. The
KV-token budget, when enabled, tracks the KV this sidecar has admitted into each pool against the capacity
the servers publish, and refuses requests that would push it past the target utilization. Every fresh
sample gives the budget the engine's own KV reading (`observe_engine`); when the pool goes stale the budget
keeps the last known capacity and books whole lifetimes again until samples return.

Served names: an engine that lists its names (vLLM's `/v1/models`) has its aliases and LoRA adapters mapped
to its pool (`served_as`), so they count against the base model's `limits.models.<pool>` and KV budget; a
name neither the config nor any listing names is refused (404 `model_not_found`) unless
`feedback.unserved_models: admit`. A name the config names keeps its static `models.<name>.pool`.

A config reload that changes the feed or the controller settings restarts the loop; until the new loop
has fresh samples its pools sit at the stale scale, never at full limits.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Protocol

from prometheus_client import CollectorRegistry

from extproc.core.engine.adaptive import ControllerState
from extproc.core.engine.tally import EngineTally
from extproc.core.kv.budget import BookingMode, KvBudget
from extproc.core.kv.config import KvBudgetConfig
from extproc.core.kv.fairness import FairShare
from extproc.core.ports import KvBoard
from extproc.kvfeed.subscriber.aggregate import PoolSnapshot
from extproc.kvfeed.subscriber.engine_budgets import EngineBudgets, endpoint_key
from extproc.kvfeed.subscriber.fleet import FleetExchange
from extproc.kvfeed.subscriber.loop import FeedbackLoop
from extproc.kvfeed.subscriber.metrics import FeedbackMetrics, register_feedback_metrics
from extproc.kvfeed.subscriber.settings import FeedbackConfig

log = logging.getLogger(__name__)

SetScale = Callable[[str, float], None]


class ServedPolicy(Protocol):
    """What `served_as` reads of the config a request is admitted under (admission's `AdmissionRules` is
    one): this package takes the behaviour it needs, never the config's classes."""

    @property
    def refuse_unserved(self) -> bool:
        """`feedback.unserved_models: refuse`."""
        ...

    def names_model(self, model: str) -> bool:
        """Whether the config names `model` itself (its `models` or `limits.models`, not `models."*"`)."""
        ...


def pool_key(pool: str) -> str:
    """The limiter key whose limits a pool's scale applies to."""
    return f"model:{pool}"


class FeedbackRuntime:
    def __init__(
        self,
        registry: CollectorRegistry,
        set_scale: SetScale,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.metrics: FeedbackMetrics = register_feedback_metrics(registry)
        self._set_scale = set_scale
        self._clock = clock
        self._config = FeedbackConfig()
        self._pools: tuple[str, ...] = ()
        self.loop: FeedbackLoop | None = None
        self._budgets: dict[str, KvBudget] = {}
        self._engines = EngineBudgets(self._budgets)  # those of them that are one engine's
        self._scaled: set[str] = set()
        self._fleet: FleetExchange | None = None
        self._fallback_share = 1.0
        self._down: set[str] = set()  # pools last seen with no live endpoint (logged when that changes)
        self.on_room: Callable[[], None] = lambda: None  # the admission queue's pump (`_peers_seen`)

    def share_through(self, board: KvBoard | None, fallback_share: float) -> None:
        """Replicas share the pools' KV budgets through `board` (a shared store's; None: this replica books
        its configured share alone), each booking `fallback_share` of a pool while the board cannot say
        what the others hold (`core.kv_fleet`). Called once, before the feed starts."""
        self._fallback_share = fallback_share
        if board is None:
            return
        floor = self._replicas_at_least
        self._fleet = FleetExchange(board, self._clock, self._peers_seen, self.engine_tally, floor)
        for budget in self._budgets.values():
            budget.share_through_store(fallback_share)

    @property
    def config(self) -> FeedbackConfig:
        return self._config

    async def apply(self, config: FeedbackConfig, pools: Iterable[str] = ()) -> None:
        """Start, restart or stop the feed so that it matches `config`.

        `pools` are the model pools with limits of their own: each gets a controller from the start, so a
        feed that never delivers holds them at the stale scale instead of leaving them at full limits.
        """
        pools = tuple(sorted(set(pools)))
        if (config, pools) == (self._config, self._pools) and (self.loop is not None) == config.enabled:
            return
        await self.stop(reset=config.subscriber is None)
        self._config, self._pools = config, pools
        if not config.kv_budget.enabled:
            for key in self._engines.clear():
                self.metrics.forget_budget(key)
            self._budgets.clear()
        if config.subscriber is None:
            return
        adaptive = {pool: config.adaptive_default for pool in pools} | dict(config.adaptive_pools)
        self.loop = FeedbackLoop(
            config.subscriber,
            adaptive,
            clock=self._clock,
            on_update=self._on_update,
            default_adaptive=config.adaptive_default,
            metrics=self.metrics,
            kv_aggregation=config.kv_aggregation,
            on_sample=self._on_sample,
            on_engine_sample=self._on_engine_sample,
            on_engines_forgotten=self._engines_forgotten,
        )
        await self.loop.start()
        # Controllers start stale; "no change" is never reported for them, so push their scale now.
        for pool, state in self.loop.states().items():
            self._on_update(pool, state)
        log.info("kv feedback started", extra={"pools": sorted(adaptive)})

    async def stop(self, reset: bool = True) -> None:
        """Stop the feed. With `reset` (feedback turned off) every scaled key gets its base limits back;
        on a restart or at shutdown the scales stay where they are."""
        if self.loop is not None:
            await self.loop.stop()
            self.loop = None
        if self._fleet is not None:
            await self._fleet.close()
        if reset:
            for key in self._scaled:
                self._set_scale(key, 1.0)
            self._scaled.clear()

    def _on_update(self, pool: str, state: ControllerState) -> None:
        key = pool_key(pool)
        self._set_scale(key, state.scale)
        self._scaled.add(key)
        budget = self.budget(pool)
        if budget is not None and self.loop is not None:
            capacity = self.loop.capacity_tokens(pool)
            if capacity is not None:  # a stale pool keeps its last capacity: lifetime booking, not none
                budget.set_capacity(capacity)
            self.metrics.observe_budget(pool, budget, self._clock())
        log.debug("pool state", extra={"pool": pool, "scale": state.scale, "stale": state.stale})
        if state.engine_down and pool not in self._down:
            self._down.add(pool)
            log.warning("engine down: no endpoint of the pool accepts connections", extra={"pool": pool})
        elif not state.engine_down and pool in self._down:
            self._down.discard(pool)
            log.warning("engine back: an endpoint of the pool is up", extra={"pool": pool})

    def _on_sample(self, pool: str, snapshot: PoolSnapshot, now: float) -> None:
        """A fresh sample: the budget learns the engine's KV in use and trusts forecasts a while longer; a
        pool without one still exchanges its runs with the other replicas (`FleetExchange.runs_changed`)."""
        budget = self.budget(pool)
        if budget is None:
            if self._fleet is not None:
                self._fleet.runs_changed(pool)
            return
        prompted = self.loop.prompted(pool) if self.loop is not None else None
        self._observe(pool, pool, budget, snapshot, now, prompted)

    def _on_engine_sample(self, pool: str, endpoint: str, now: float) -> None:
        """A fresh sample of one engine whose budget books what a picker sent it: that budget reads it."""
        key = endpoint_key(pool, endpoint)
        budget = self._budgets.get(key)
        if budget is None or self.loop is None:  # most engines: no picker named them
            return
        snapshot = self.loop.endpoint_snapshot(pool, endpoint)
        if snapshot is None or snapshot.stale:
            return
        self._observe(pool, key, budget, snapshot, now, self.loop.endpoint_prompted(pool, endpoint))

    def _observe(
        self,
        pool: str,
        key: str,
        budget: KvBudget,
        snapshot: PoolSnapshot,
        now: float,
        prompted: float | None,
    ) -> None:
        """`budget` (under `key`: its pool's, or one engine's) reads `snapshot`, its engines' state now."""
        if snapshot.kv_capacity_tokens is not None:
            budget.set_capacity(snapshot.kv_capacity_tokens)
        budget.set_replicas(snapshot.endpoints_known)
        budget.set_block_tokens(snapshot.kv_block_tokens)
        budget.set_engine_shares_prefixes(snapshot.prefix_caching is not False)
        adaptive = self._config.adaptive_pools.get(pool, self._config.adaptive_default)
        waiting = snapshot.requests_waiting if snapshot.waiting_known else None
        running = snapshot.requests_running if snapshot.running_known else None
        budget.observe_fed_pace(snapshot.decode_tokens_per_second, running)
        stale_after = adaptive.stale_after_seconds
        used = snapshot.kv_used_tokens
        used = None if used is None else used + snapshot.kv_spread_tokens  # as full as its fullest engine
        budget.observe_engine(used, now, stale_after, waiting, running, prompted)
        if self._fleet is not None:
            self._fleet.changed(key, budget)
        self.metrics.observe_budget(key, budget, now)
        self.metrics.observe_fairness(key, budget, now)

    def _engines_forgotten(self, engines: set[tuple[str, str]]) -> None:
        """The feed's loop forgot `engines` (pool, endpoint): their budgets go, with their series, as soon
        as no request holds them (`EngineBudgets`)."""
        for key in self._engines.forgotten(engines):
            self._dropped(key)

    def _dropped(self, key: str) -> None:
        self.metrics.forget_budget(key)
        if self._fleet is not None:
            self._fleet.forget(key)

    def endpoint_budget(self, pool: str, endpoint: str) -> tuple[str, KvBudget] | None:
        """The KV budget of one engine of `pool`, which books the requests a picker sent it, and its key
        (`endpoint_key`); None where the pool has no budget or the feed has no fresh reading of that
        engine (the pool's budget books the request then). Only engines the feed reads get one, so a header
        value cannot grow memory or metric labels."""
        if self.budget(pool) is None or self.loop is None:
            return None
        snapshot = self.loop.endpoint_snapshot(pool, endpoint)
        if snapshot is None or snapshot.stale or snapshot.kv_capacity_tokens is None:
            return None  # unread, or its capacity unknown: a budget of it would admit anything
        key, budget = self._engines.get(pool, endpoint)
        if budget is None:
            budget = self._new_budget(snapshot.kv_capacity_tokens)
            budget.fleet.expect(self._replicas_at_least(key, pool), self._clock())
            self._engines.add(pool, endpoint, budget)
        return key, budget

    def budget(self, pool: str) -> KvBudget | None:
        """The pool's KV-token budget; None when budgets are off or the feed does not know the pool.

        Pools are model names sent by clients: only pools the feed reports (or the config names) get a
        budget, so made-up model names cannot grow memory or metric labels.
        """
        settings = self._config.kv_budget
        if not settings.enabled:
            return None
        budget = self._budgets.get(pool)
        if budget is None and (self.loop is None or self.loop.state(pool) is None):
            return None
        if budget is None:
            capacity = self.loop.capacity_tokens(pool) if self.loop is not None else None
            budget = self._budgets[pool] = self._new_budget(capacity)
        return budget

    def _new_budget(self, capacity: int | None) -> KvBudget:
        """A budget as `kv_budget` sets it, of `capacity` tokens, shared with the other replicas where a
        store is."""
        settings = self._config.kv_budget
        budget = KvBudget(
            target_utilization=settings.target_utilization,
            capacity_share=settings.capacity_share,
            booking=BookingMode(settings.booking),
            prefix_sharing=settings.prefix_sharing,
            min_completion_ratio=settings.min_completion_ratio,
            unconfirmed_share=settings.unconfirmed_share,
            fairness=fair_share(settings),
        )
        budget.set_capacity(capacity)
        if self._fleet is not None:
            budget.share_through_store(self._fallback_share)
        return budget

    def served_as(self, model: str, rules: ServedPolicy) -> str | None:
        """The name whose model policy and pool a request for `model` uses; None: refuse it as unserved.

        The config first (a configured name keeps its static `pool`, for engines that do not list), then
        the engines' lists in the feed (an alias or adapter uses its base pool), then, when some engine
        lists and unserved names are refused, None; otherwise the name itself (the `models."*"` pool).
        """
        if rules.names_model(model):
            return model
        if self.loop is None:
            return model
        pool = self.loop.served.pool_of(model)
        if pool is not None:
            return pool
        if rules.refuse_unserved and self.loop.served.listing:
            return None
        return model

    def feeds_pool(self, pool: str) -> bool:
        """Whether the feed reports `pool` (an engine serves it): the pools a budget can exist for."""
        return self.loop is not None and self.loop.state(pool) is not None

    def kv_usage(self, pool: str) -> float | None:
        """The pool's current aggregated KV usage; None without a fresh sample."""
        if self.loop is None:
            return None
        state = self.loop.state(pool)
        if state is None or state.stale:
            return None
        return state.kv_usage

    def decode_rate(self, pool: str) -> float | None:
        """The pool's decode pace per sequence from the engines' counters (`kvfeed.pace`), None without a
        fresh one: the fallback of `PoolPaces` while the pool has no pace learned from its streams."""
        return self.loop.decode_tokens_per_second(pool) if self.loop is not None else None

    def engine_tally(self, key: str) -> EngineTally | None:
        """The generation counters over time (`core.engine_tally`) of the pool's engines, or of one engine
        where `key` is the key of its budget (`endpoint_budget`: the request was booked there), None
        without them: what admission counts a request whose answer was not seen whole with."""
        if self.loop is None:
            return None
        engine = self._engines.engine_of(key)
        return self.loop.engine_tally(key) if engine is None else self.loop.endpoint_tally(*engine)

    def engine_down_for(self, pool: str) -> float | None:
        """How long (seconds) the feed has shown no live endpoint of `pool` (`FeedbackLoop.engine_down_for`);
        None while it is not down, or without the feed: admission then forwards as ever."""
        return self.loop.engine_down_for(pool) if self.loop is not None else None

    def engine_refused(self, pool: str) -> None:
        """An engine of `pool` refused an admitted request, its queue full: the pool's scale drops at once
        (`FeedbackLoop.engine_refused`); nothing without the feed, which owns the scales."""
        if self.loop is not None:
            self.loop.engine_refused(pool)

    def _replicas_at_least(self, key: str, pool: str | None = None) -> int:
        """The other replicas an engine's budget counts on: as many as its pool's budget knows live (they may
        send a request to that engine at any moment); none for a pool's own."""
        engine = self._engines.engine_of(key)
        pool = pool if engine is None else engine[0]
        budget = None if pool is None else self._budgets.get(pool)
        peers = None if budget is None else budget.fleet.peers(self._clock())
        return 0 if peers is None else peers.replicas

    def _peers_seen(self, pool: str) -> None:
        """The others' figures reached `pool`'s budget: its gauges; the queue pumped (`FleetOrder.first`)."""
        budget = self._budgets.get(pool)
        if budget is not None:
            self.metrics.observe_budget(pool, budget, self._clock())
        if budget is not None and budget.fleet.order.first:
            self.on_room()

    def budget_changed(self, pool: str) -> None:
        """A pool's budget changed (a decision, a release, progress, the others' figures): its gauges, and
        its figures to the other replicas (`FleetExchange`, at most every `kv_fleet.PUBLISH_EVERY_S`)."""
        budget = self._budgets.get(pool)
        if budget is not None:
            self.metrics.observe_budget(pool, budget, self._clock())
            if self._fleet is not None:
                self._fleet.changed(pool, budget)
            if self._engines.drop_if_idle(pool):  # its engine forgotten, its last lease gone
                self._dropped(pool)


def fair_share(settings: KvBudgetConfig) -> FairShare | None:
    """A pool budget's fair shares between tenants, as `kv_budget` sets them; None when turned off."""
    if not settings.fair_shares:
        return None
    return FairShare(
        half_life_s=settings.service_half_life_seconds,
        claim_ttl_s=settings.claim_seconds,
        weights=dict(settings.tenant_weights),
    )
