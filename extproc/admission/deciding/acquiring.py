"""A request's way to a lease: taken at once, or waited for in its class's queue.

    try now (its KV booked where it fits) ─▶ lease, or the limiter's rejection
        ─▶ where the request may wait and the refusal is one waiting cures: its deadline checked against
           the queue's layout ─▶ Hold ─▶ the queue's wait ─▶ lease, or the refusal that ended the wait

`Acquisition` is one request's; the decision (decision.py) makes one per try and turns its result into the
outcome. It takes nothing it does not give back: the KV booking is given back with a refused try.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import AsyncIterator, Callable

from extproc.admission.capacity.booking import KvGate
from extproc.admission.capacity.queueing import WAITABLE, AdmissionQueue, DeadlineUnmet, QueueFull
from extproc.admission.deciding.candidate import RequestFacts
from extproc.admission.intake.rules import AdmissionRules
from extproc.admission.replies import refusals
from extproc.admission.replies.verdicts import Hold, Refusal
from extproc.admission.service import AdmissionService
from extproc.core.limiter.limiter import Lease, RateLimitStatus, Rejection
from extproc.core.ports import StoreUnavailable

Refuse = Callable[[RateLimitStatus | None], Refusal]
"""A refusal decided, awaiting the limiter's view of the request's keys for its `x-ratelimit-*` headers."""


class Acquisition:
    """One request's tries for a lease on the limiter keys of its tenant and of `limit_pool`, the pool whose
    `model:<pool>` limits apply, under the decision's `rules` (see the module docstring)."""

    def __init__(
        self, service: AdmissionService, request: RequestFacts, limit_pool: str, rules: AdmissionRules
    ) -> None:
        self.service = service
        self.request = request
        self.limit_pool = limit_pool
        self.rules = rules

    def keys(self, model: bool = True) -> list[str]:
        """The limiter keys of this request, and the derived keys of those with split input/output limits;
        without its model's (`model` False) where which model it asks is not known yet."""
        keys = ["global", f"model:{self.limit_pool}", f"tenant:{self.request.tenant}"]
        return self.rules.split_keys.keys_for(keys if model else [keys[0], keys[2]])

    def may_wait(self, shadow: bool) -> bool:
        """Whether this request may wait in its class's queue (not in shadow mode: it would delay it)."""
        return self.service.deps.queue is not None and self.request.klass.queues and not shadow

    async def run(
        self, gate: KvGate, waits: bool, run_s: float = 0.0
    ) -> AsyncIterator[Lease | Rejection | Refusal | Hold]:
        """Take a lease for `gate.plan` now, or, where the request `waits`, wait for one in the class's
        queue; yields `Hold` before waiting, then the result: a lease, the limiter's rejection, or a refusal
        (queue full or timed out, store down). `gate`: its KV, booked for the try now where it fits (else
        it queues at once, which only a class that queues is let do), given back while it waits, and booked
        again the moment it fits; `run_s`: how long it will hold the lease, weighed by the deadlines of the
        requests behind it. The reserved completion is what an `output:` key's bucket holds (split limits:
        extproc/core/limiter/split.py)."""
        klass, service, plan = self.request.klass, self.service, gate.plan
        queue = service.deps.queue
        behind = queue is not None and queue.must_queue(klass.name)
        keys = self.keys()
        result: Lease | Rejection | Refusal | Hold | None = None
        try:
            if not (behind and waits) and gate.take():
                # Waiters of a higher class are ahead: a class that does not queue may still use its own
                # guarantee, but not the pool they are waiting for.
                result = await service.acquire(
                    keys, plan.total, klass.name, use_pool=not behind, output_tokens=plan.completion_tokens
                )
                if not isinstance(result, Lease):
                    gate.close()
            if waits and (result is None or (isinstance(result, Rejection) and result.reason in WAITABLE)):
                assert queue is not None
                refused = result if isinstance(result, Rejection) else None
                async for result in self._wait(queue, keys, gate, run_s, refused):
                    if isinstance(result, Hold):
                        yield result
        except StoreUnavailable:
            yield refusals.store_unavailable()
            return
        assert result is not None
        yield result

    async def _wait(
        self, queue: AdmissionQueue, keys: list[str], gate: KvGate, run_s: float, refused: Rejection | None
    ) -> AsyncIterator[Lease | Rejection | Refusal | Hold]:
        """Wait in the class's queue, `refused` so by the try now (None: it did not fit the KV or queued
        behind others): `Hold` first, then the lease, or the rejection or refusal that ended the wait. Each
        refusal carries the limiter's view of the request's keys (`status`)."""
        max_wait, by_deadline = self._max_wait()
        refuse = self._deadline_unmet(queue, keys, run_s, refused)
        if refuse is not None:
            yield refuse(await self.status())  # its deadline is out of reach: refused now, not when it passes
            return
        # The proxy's per-message timer must not fire while the request waits for capacity.
        yield Hold(math.ceil(max_wait) + 1)
        request, plan = self.request, gate.plan
        klass = request.klass
        # Not refused by the limiter: it waits for KV (its own, or the waiters' ahead of it), in the fleet's
        # order too.
        in_order = gate.booking.waiting() if refused is None else contextlib.nullcontext()
        try:
            with in_order:
                result = await queue.wait(
                    keys,
                    plan.total,
                    klass.name,
                    request.tenant,
                    max_wait,
                    request.deadline,
                    refused,
                    run_s,
                    gate,
                    plan.completion_tokens,
                )
        except QueueFull as exc:
            status = await self.status()
            told = klass.max_wait_seconds if exc.eta is None else max_wait
            yield refusals.queue_refused("queue_full", klass.name, told, status, exc.eta)
            return
        except DeadlineUnmet as exc:
            yield refusals.deadline_unmet(klass.name, request.deadline_ms or 0, exc.eta, await self.status())
            return
        if result is None:
            if by_deadline:
                yield self._deadline_passed()(await self.status())
            else:
                status = await self.status()
                yield refusals.queue_refused("queue_timeout", klass.name, max_wait, status=status)
            return
        yield result

    async def status(self, keys: list[str] | None = None) -> RateLimitStatus | None:
        """The limiter's view of this request's `keys` (default: all of them) for its class, for a 429's
        `x-ratelimit-*` headers: OpenAI sends them on every 429 and SDK users read them off whichever 429
        they get. None where the store cannot say now (`StoreUnavailable`): the refusal goes without them
        rather than fail."""
        asked = self.keys() if keys is None else keys
        try:
            return await self.service.deps.store.status(asked, self.request.klass.name)
        except StoreUnavailable:
            return None

    def _max_wait(self) -> tuple[float, bool]:
        """How long this request may wait in its class's queue (`AdmissionRules.queue_wait`: the smallest
        of the global, class and request bounds), and whether its own deadline is the bound that ends it."""
        request, rules = self.request, self.rules
        left = None if request.deadline is None else request.deadline - self.service.clock()
        others = rules.queue_wait(request.klass, None)
        wait = rules.queue_wait(request.klass, left)
        return wait, left is not None and left <= others

    def _deadline_unmet(
        self, queue: AdmissionQueue, keys: list[str], run_s: float, result: Rejection | None
    ) -> Refuse | None:
        """A refusal when this request's deadline is out of reach before it waits: already passed, or
        earlier than its capacity is expected, or met only by pushing a request already waiting in time
        out of its own (`AdmissionQueue.deadline_refusal`, on the refusal it met trying, else its class's
        last). Where nothing tells (no refusal of a key it needs, leases held by other replicas), it
        waits, and its deadline ends the wait."""
        request = self.request
        if request.deadline is None:
            return None
        klass, ms = request.klass.name, request.deadline_ms or 0
        if request.deadline <= self.service.clock():
            return self._deadline_passed()
        blocked = result if isinstance(result, Rejection) else queue.blocked(klass)
        if blocked is None or blocked.key not in keys:
            return None  # another tenant's or pool's own limit says nothing of this request's wait
        eta = queue.deadline_refusal(klass, request.tenant, keys, request.deadline, run_s, blocked)
        return None if eta is None else lambda status: refusals.deadline_unmet(klass, ms, eta, status)

    def _deadline_passed(self) -> Refuse:
        """The request's own deadline ended its wait (or had passed before it began)."""
        klass, ms = self.request.klass.name, self.request.deadline_ms or 0
        return lambda status: refusals.deadline_unmet(klass, ms, None, status)
