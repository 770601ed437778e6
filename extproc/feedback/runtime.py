"""Connects the KV feed to the sidecar's limits: adaptive scales, KV-token budgets and their metrics.

Each pool is a served model name. A pool's scale multiplies the base limits of its `model:<name>` key, so
an operator gives each model pool its own `limits.models.<name>` entry for the feedback to act on. The
KV-token budget, when enabled, tracks the KV footprint this sidecar has admitted into each pool against
the capacity the servers publish, and refuses requests that would push it past the target utilization.

A config reload that changes the feed or the controller settings restarts the loop; until the new loop
has fresh samples its pools sit at the stale scale, never at full limits.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry

from extproc.config import FeedbackConfig
from extproc.core.adaptive import ControllerState
from extproc.core.kv_budget import KvBudget
from extproc.feedback.loop import FeedbackLoop
from extproc.feedback.metrics import FeedbackMetrics, register_feedback_metrics

log = logging.getLogger(__name__)

SetScale = Callable[[str, float], None]


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
        self.loop: FeedbackLoop | None = None
        self._budgets: dict[str, KvBudget] = {}
        self._scaled: set[str] = set()

    @property
    def config(self) -> FeedbackConfig:
        return self._config

    async def apply(self, config: FeedbackConfig) -> None:
        """Start, restart or stop the feed so that it matches `config`."""
        if config == self._config and (self.loop is not None) == config.enabled:
            return
        await self.stop()
        self._config = config
        if not config.kv_budget.enabled:
            self._budgets.clear()
        if config.subscriber is None:
            return
        self.loop = FeedbackLoop(
            config.subscriber,
            config.adaptive_pools,
            clock=self._clock,
            on_update=self._on_update,
            default_adaptive=config.adaptive_default,
            metrics=self.metrics,
            kv_aggregation="mean" if config.kv_aggregation == "mean" else "max",
        )
        await self.loop.start()
        log.info("kv feedback started", extra={"pools": sorted(config.adaptive_pools)})

    async def stop(self) -> None:
        if self.loop is not None:
            await self.loop.stop()
            self.loop = None
        # Without a feed nothing justifies a reduced limit: give every scaled key its base limits back.
        for key in self._scaled:
            self._set_scale(key, 1.0)
        self._scaled.clear()

    def _on_update(self, pool: str, state: ControllerState) -> None:
        key = pool_key(pool)
        self._set_scale(key, state.scale)
        self._scaled.add(key)
        budget = self.budget(pool)
        if budget is not None and self.loop is not None:
            budget.set_capacity(self.loop.capacity_tokens(pool))
            self.metrics.observe_budget(pool, budget)
        log.debug("pool state", extra={"pool": pool, "scale": state.scale, "stale": state.stale})

    def budget(self, pool: str) -> KvBudget | None:
        """The pool's KV-token budget, or None when budgets are off."""
        settings = self._config.kv_budget
        if not settings.enabled:
            return None
        budget = self._budgets.get(pool)
        if budget is None:
            budget = KvBudget(
                target_utilization=settings.target_utilization, capacity_share=settings.capacity_share
            )
            if self.loop is not None:
                budget.set_capacity(self.loop.capacity_tokens(pool))
            self._budgets[pool] = budget
        return budget

    def kv_usage(self, pool: str) -> float | None:
        """The pool's current aggregated KV usage; None without a fresh sample."""
        if self.loop is None:
            return None
        state = self.loop.state(pool)
        if state is None or state.stale:
            return None
        return state.kv_usage

    def budget_changed(self, pool: str) -> None:
        budget = self._budgets.get(pool)
        if budget is not None:
            self.metrics.observe_budget(pool, budget)
