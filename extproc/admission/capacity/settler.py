"""Settling a lease, exactly once per lease, and counting what it cost: the store releases the lease to what
was charged (`charging.py` says what), the KV budget gives back the request's entry, and the settlement
metrics record the outcome, the tokens settled, refunded and overrun. A lease whose engine is done before
its client has read the answer gives its slots back first (`release_slot`), counted and logged. An
engine's refusal (its queue full) also tells the pool's adaptive scale at once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from extproc.admission.capacity.admitted import Admitted
from extproc.admission.capacity.charging import Charge, Ending
from extproc.admission.capacity.queueing import AdmissionQueue
from extproc.core.ports import LimiterStore
from extproc.metrics import LabelledChildren, Metrics

log = logging.getLogger(__name__)

ENGINE_REFUSAL_REASON = "queue_full"
"""The `reason` of `extproc_engine_refusals_total`: the only refusal recognized, an engine's 503
(`settlement.ENGINE_BUSY_STATUSES`); vLLM's own counter, which the feed reads, tells requests from tokens."""


class Settler:
    """Releases admitted requests' leases and counts each settlement (see the module docstring)."""

    def __init__(
        self,
        store: LimiterStore,
        metrics: Metrics,
        child: LabelledChildren,
        track: Callable[[asyncio.Future[Any]], asyncio.Future[Any]],
        engine_refused: Callable[[str], None],
        queue: AdmissionQueue | None = None,
    ) -> None:
        self.store = store
        self.metrics = metrics
        self.child = child
        self.track = track
        self.engine_refused = engine_refused
        self.queue = queue

    def settle(self, admitted: Admitted, charge: Charge) -> asyncio.Future[bool]:
        """Release the lease to what was used, update the KV budget, count it; exactly once per lease."""
        if charge.ending is Ending.ENGINE_BUSY:
            self._engine_refused(admitted)
        completed = charge.ending == "completed"
        admitted.booking.release(charge.completion if completed else None)
        future = asyncio.ensure_future(self.store.release(admitted.lease, charge.total, charge.completion))
        future.add_done_callback(lambda done: self._account(done, admitted, charge))
        self.track(future)
        return future

    def release_slot(self, admitted: Admitted, early: bool = True) -> asyncio.Future[bool]:
        """Give the lease's slots back before it settles: the store frees them at most once, and `settle`
        later charges its tokens as ever. `early`: the engine is done with it while its client still reads
        (counted and logged as such); else the request has ended and only its count is awaited."""
        future = asyncio.ensure_future(self.store.release_slot(admitted.lease))
        future.add_done_callback(lambda done: self._slot_back(done, admitted, early))
        self.track(future)
        return future

    def _slot_back(self, done: asyncio.Future[bool], admitted: Admitted, early: bool) -> None:
        if done.cancelled() or done.exception() is not None or not done.result():
            return  # settled meanwhile, or the store kept the slot: the settlement frees it
        if self.queue is not None:
            self.queue.kick()
        if not early:
            return
        self.child(self.metrics.slots_released_early, admitted.model_label).inc()
        log.info(
            "slot released early: the engine is done, the client still reads",
            extra={
                "model": admitted.model_label,
                "class": admitted.klass.name,
                "lease": admitted.lease.lease_id,
            },
        )

    def _engine_refused(self, admitted: Admitted) -> None:
        """The engine refused this request (its queue full): counted apart from engine failures, and the
        pool's scale told at once, as an engine queue at `waiting_high` would (docs/feedback.md)."""
        self.child(self.metrics.engine_refusals, admitted.model_label, ENGINE_REFUSAL_REASON).inc()
        log.info("engine refused an admitted request", extra={"model": admitted.model_label})
        try:
            self.engine_refused(admitted.pool)
        except Exception:
            log.exception("engine refusal hook failed", extra={"model": admitted.model_label})

    def _account(self, done: asyncio.Future[bool], admitted: Admitted, charge: Charge) -> None:
        model = admitted.model_label
        if done.cancelled() or done.exception() is not None:
            log.error("lease settlement failed", extra={"model": model})
            self.metrics.settlements.labels("failed").inc()
            return
        if self.queue is not None:
            self.queue.kick()
        metrics = self.metrics
        metrics.active.dec()
        child = self.child
        child(metrics.settlements, charge.ending.value).inc()
        child(metrics.tokens_settled, model, "prompt").inc(charge.prompt)
        child(metrics.tokens_settled, model, "completion").inc(charge.completion)
        if charge.cached:
            child(metrics.tokens_cached_prompt, model).inc(charge.cached)
        delta = admitted.lease.reserved_tokens - charge.total
        if delta > 0:
            child(metrics.tokens_refunded, model).inc(delta)
        elif delta < 0:
            child(metrics.tokens_overrun, model).inc(-delta)
        log.debug(
            "lease settled",
            extra={
                "outcome": charge.ending.value,
                "reserved": admitted.lease.reserved_tokens,
                "actual": charge.total,
                "model": model,
            },
        )
