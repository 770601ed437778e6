"""Admission on a bound where the bound decides; the exact count after, off the critical path.

A prompt's tokens lie between two bounds that cost nothing to compute (`prompt.lower_bound`,
`prompt.upper_bound`): the sidecar's encoding is a BPE over bytes whose every token stands for at least one
byte, and `count_text` encodes special-token strings as ordinary text, so text of B bytes is at most B
tokens; everything else a count adds (token-id arrays, template overhead, media) is the same fixed number in
the bound and in the count. When the reservation planned on the upper bound differs from the one planned on
the lower bound only in its prompt tokens (same completion bound, same injected `max_tokens`, no refusal),
the exact count cannot change the decision's outcome, only how many prompt tokens it holds. Then, if the
upper bound also fits the KV budget and the buckets, the request is admitted on it at once and counted
exactly afterwards; the reservation (in the limiter store, `LimiterStore.refund`) and the KV booking
(`KvBudget.correct_prompt`) are lowered to the exact count when it lands.

A request near a limit waits for the exact count as before: near the context window (the bounds disagree on
the completion it may generate, or the upper bound does not fit), when the upper bound does not fit the KV
budget or a bucket (it is then counted and tried again on the exact count, so an over-estimate never refuses
it), when it must queue, and in shadow mode.

The correction happens exactly once, whatever comes first (`Stage`):

    COUNTING ──count──▶ REFUNDING ──store answered──▶ CORRECTED
       │                                      ▲
       ├──request ended first: its settlement waits for the count, and charges the exact prompt──┘
       └──count failed (tokenizer backlog full, ...) ──▶ ABANDONED: the bound stays reserved (the safe side)

A settlement requested while the count or the refund is in flight is held and run right after it, with the
corrected reservation; the store never sees a refund and a release of the same lease race.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Callable
from dataclasses import replace

from extproc.admission.capacity.admitted import Admitted
from extproc.admission.capacity.booking import KvBooking
from extproc.admission.capacity.lanes import LaneFull
from extproc.admission.deciding.candidate import Candidate
from extproc.admission.deciding.resolving import Resolved
from extproc.admission.intake.request import ParsedRequest
from extproc.admission.intake.reservation import Reservation, plan_reservation
from extproc.admission.intake.rules import AdmissionRules
from extproc.admission.service import AdmissionService
from extproc.admission.vocabulary import prompt as prompts
from extproc.admission.vocabulary.errors import AdmissionError
from extproc.admission.vocabulary.policy import ClassPolicy, ModelPolicy, StepBounds
from extproc.admission.vocabulary.prompt import Count

log = logging.getLogger(__name__)

Settle = Callable[[Admitted], None]


class Stage(enum.Enum):
    """Where a bound admission's correction stands."""

    COUNTING = "counting"  # admitted on the upper bound; the exact count runs
    REFUNDING = "refunding"  # counted: the store gives the difference back
    CORRECTED = "corrected"  # reservation and KV booking at the exact count (or settled with it)
    ABANDONED = "abandoned"  # the count failed: the bound stays reserved and is settled as such


def bound_plan(req: ParsedRequest, policy: ModelPolicy, bounds: StepBounds) -> Reservation | None:
    """The reservation on the prompts' upper bounds where the bounds decide, else None (count first).

    Every check of `plan_reservation` is monotone in the prompt's count: if the upper bound passes them,
    every smaller count does; and if the lower bound gives the same completion bound, injected `max_tokens`
    and declared output floor, so does every count between. Opaque prompts (charged a whole window) never
    take this path.
    """
    if not req.prompts or any(p.opaque for p in req.prompts):
        return None
    highs: list[Count] = []
    lows: list[Count] = []
    for prompt in req.prompts:
        most, least = prompts.upper_bound(prompt, policy), prompts.lower_bound(prompt, policy)
        highs.append(Count(most, most))
        lows.append(Count(least, least))
    try:
        high = plan_reservation(req, highs, policy, bounds)
        low = plan_reservation(req, lows, policy, bounds)
    except AdmissionError:
        return None  # near the window (or another count-dependent limit): the exact count decides
    completion_terms = (high.completion_tokens, high.injected_max_tokens, high.committed_completion_tokens)
    if completion_terms != (low.completion_tokens, low.injected_max_tokens, low.committed_completion_tokens):
        return None
    return high


def on_bound(
    service: AdmissionService,
    klass: ClassPolicy,
    resolved: Resolved,
    booking: KvBooking,
    rules: AdmissionRules,
    lane: str,
) -> Candidate | None:
    """The try on the prompt's upper bound where it decides (`bound_plan`, `may_admit_on_bound`), else None:
    the request must be counted first (near the window, when the bound does not fit the KV budget, when it
    must queue)."""
    plan = bound_plan(resolved.parsed, resolved.policy, rules.per_step)
    if plan is None:
        return None
    candidate = Candidate(resolved.parsed, resolved.policy, resolved.pool, plan, booking, on_bound=True)
    return candidate if may_admit_on_bound(service, klass, candidate, lane, rules) else None


def may_admit_on_bound(
    service: AdmissionService, klass: ClassPolicy, candidate: Candidate, lane: str, rules: AdmissionRules
) -> bool:
    """Whether to try the bound at all, under the decision's `rules`: not in shadow mode, not when the class
    must queue behind others (a queued request waits for its exact need, not an over-estimate), not when the
    client's tokenizer lane is busy, and only if it fits the KV budget."""
    if not rules.bound_admission or rules.shadow or klass.shadow:
        return False
    queue = service.deps.queue
    if queue is not None and queue.must_queue(klass.name):
        return False
    if candidate.parsed.text_bytes > rules.tokenizing.inline_count_bytes and not service.lanes.free(lane):
        # The count after would wait in the client's tokenizer lane, where it could delay (or, past the
        # lane's backlog, refuse) the client's next request: count this one first instead.
        return False
    return candidate.fits(claim=False)[0]


class Correction:
    """The exact count of one bound admission and the one correction it leads to (module docstring)."""

    def __init__(self, service: AdmissionService, lane: str) -> None:
        self.service = service
        self.lane = lane
        self.stage = Stage.COUNTING
        self.refunded = 0  # tokens the store gave back early (0 when the settlement absorbed the difference)
        self._settle: Settle | None = None
        self._on_corrected: Callable[[Admitted], None] | None = None
        self.task: asyncio.Future[None] | None = None

    @property
    def pending(self) -> bool:
        return self.stage in (Stage.COUNTING, Stage.REFUNDING)

    def start(self, admitted: Admitted, on_corrected: Callable[[Admitted], None]) -> None:
        """Count `admitted`'s prompts in the background; `on_corrected` receives the corrected admission.
        Only the first call starts anything."""
        if self.task is not None:
            return
        self._on_corrected = on_corrected
        self.task = self.service.track(asyncio.ensure_future(self._run(admitted)))

    def defer(self, settle: Settle) -> bool:
        """Hold a settlement until the count (and any refund) is done; False: settle now, nothing pending."""
        if not self.pending:
            return False
        self._settle = settle
        return True

    async def _run(self, admitted: Admitted) -> None:
        final = admitted
        stage = Stage.ABANDONED
        try:
            counted = await self._count(admitted)
            if counted is not None:
                # A sliced count's interval may reach past the byte bound; the truth never does.
                exact = min(counted.prompt_tokens, admitted.plan.prompt_tokens)
                plan = replace(admitted.plan, prompt_tokens=exact, text_tokens=counted.text_tokens)
                final = replace(admitted, plan=plan)
                if self._on_corrected is not None:
                    self._on_corrected(final)
                if self._settle is None:
                    self.stage = Stage.REFUNDING
                    admitted.booking.correct_prompt(exact, counted.text_tokens)
                    await self._refund(admitted, admitted.plan.prompt_tokens - exact)
                stage = Stage.CORRECTED
        finally:
            self._finish(stage, final)

    async def _count(self, admitted: Admitted) -> Reservation | None:
        """The plan on the exact count, or None when counting failed."""
        request, policy = admitted.request, admitted.policy
        try:
            counts = await self.service.count_prompts(request, policy, self.lane)
            exact = plan_reservation(request, counts, policy, self.service.rules().per_step)
        except (LaneFull, AdmissionError, ValueError) as exc:
            log.info("bound admission: exact count failed, the bound stays", extra={"error": str(exc)})
            return None
        return exact

    async def _refund(self, admitted: Admitted, tokens: int) -> None:
        """Return `tokens` of the store's reservation while the request runs (its KV booking was lowered
        first, `KvBooking.correct_prompt`)."""
        if tokens <= 0:
            return
        service = self.service
        lease = admitted.lease
        before = lease.reserved_tokens
        try:
            await service.deps.store.refund(lease, tokens)
        except Exception:
            log.exception("bound admission: refund failed, the release settles the difference")
        self.refunded = before - lease.reserved_tokens
        if self.refunded > 0:
            service.child(service.metrics.tokens_refunded, admitted.model_label).inc(self.refunded)
            if service.deps.queue is not None:
                service.deps.queue.kick()

    def _finish(self, stage: Stage, admitted: Admitted) -> None:
        self.stage = stage
        settle, self._settle = self._settle, None
        if settle is not None:
            settle(admitted)
