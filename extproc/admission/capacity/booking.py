"""One request's entry in its pool's KV budget: every change admission makes to a budget goes through here.

A request is checked (`fits`), booked before the limiter's await (`hold`, so that concurrent decisions see
each other's footprints), given back if it is not admitted (`give_back`), lowered to the exact count after
an admission on the prompt's bound (`correct_prompt`), followed while it runs (`progress` from the chunks
the inline profile sees, `follow` from the decode-rate estimate where nobody sees them), and released when
it settles (`release`); a completed stream nobody watched teaches it the pool's pace (`learn_pace`), and
the feed's finding that the engine is done with it is passed on (`when_engine_done`). Each
change that can move the budget's headroom tells the feedback side (`changed`), which republishes the
pool's KV state.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator

from extproc.admission.intake.request import ParsedRequest
from extproc.admission.intake.reservation import Reservation
from extproc.admission.vocabulary.prefix import prompt_chunks, with_text_tokens
from extproc.core.clock import Clock
from extproc.core.kv.budget import KvBudget
from extproc.core.kv.prefix import NO_CHUNKS, PromptChunks

_BUDGET_IDS = itertools.count()
"""KV-budget lease ids: a request is booked before the limiter grants (and numbers) its lease."""


class KvBooking:
    """A request's footprint in `budget` (None: the pool has no KV budget, and every call is a no-op).
    `pool` is the budget's key, which `changed` publishes: its pool's, or one engine's (`pool@endpoint`)."""

    __slots__ = ("_chunks", "budget", "changed", "clock", "held", "id", "in_order", "pool", "rank", "tenant")

    def __init__(
        self,
        budget: KvBudget | None,
        pool: str,
        tenant: str,
        changed: Callable[[str], None],
        clock: Clock,
        rank: int = 0,
        in_order: bool = True,
    ) -> None:
        self.budget = budget
        self.in_order = in_order  # the model's template keeps the messages in order (`TemplateCosts`)
        self.pool = pool
        self.tenant = tenant
        self.rank = rank  # the request's class's order (0: the most important), for fair shares
        self.changed = changed
        self.clock = clock
        self.id = f"x{next(_BUDGET_IDS)}"
        self.held = False
        self._chunks: PromptChunks | None = None

    def chunks(self, request: ParsedRequest, plan: Reservation | None = None) -> PromptChunks:
        """The request's prompt chunks for the budget's prefix sharing, hashed once per request (none when
        the budget does not share prefixes), with the tokens of its texts once a plan counted them."""
        if self._chunks is None:
            sharing = self.budget is not None and self.budget.prefix_sharing
            text_tokens = plan.text_tokens if plan is not None else ()
            self._chunks = prompt_chunks(request, text_tokens, self.in_order) if sharing else NO_CHUNKS
        elif plan is not None:
            self._counted(plan.text_tokens)
        return self._chunks

    def _counted(self, text_tokens: tuple[int, ...]) -> bool:
        """The texts' tokens, once counted, for chunks hashed before (on a bound): True if they changed."""
        chunks = self._chunks
        if chunks is None or not chunks.hashes or chunks.text_tokens or not text_tokens:
            return False
        self._chunks = with_text_tokens(chunks, text_tokens)
        return bool(self._chunks.text_tokens)

    def fits(
        self, request: ParsedRequest, plan: Reservation, now: float | None = None, *, claim: bool = True
    ) -> tuple[bool, int | None]:
        """Whether the request fits the pool's KV budget at `now` (default: the clock's now), and the
        headroom before it; refused, it may claim its KV from later requests (fair shares), unless `claim`
        is False (a check on the prompt's bound, decided again on the exact count)."""
        if self.budget is None:
            return True, None
        fits = self.budget.would_fit(
            plan.prompt_tokens,
            plan.completion_tokens,
            self.tenant,
            now=self.clock() if now is None else now,
            sequences=request.sequences * request.prompt_count,
            committed=plan.committed_completion_tokens,
            chunks=self.chunks(request, plan),
            rank=self.rank,
            claim=claim,
        )
        if self.budget.fleet.must_publish:  # a replica that had yielded asks for its part of the pool back
            self.changed(self.pool)
        return fits

    def hold(self, request: ParsedRequest, plan: Reservation) -> None:
        """Book the request under an id of its own, before the limiter grants (and numbers) its lease."""
        if self.budget is None:
            return
        self.budget.admit(
            self.id,
            plan.prompt_tokens,
            plan.completion_tokens,
            self.tenant,
            now=self.clock(),
            sequences=request.sequences * request.prompt_count,
            committed=plan.committed_completion_tokens,
            chunks=self.chunks(request, plan),
            rank=self.rank,
        )
        self.held = True
        self.changed(self.pool)

    def correct_prompt(self, prompt_tokens: int, text_tokens: tuple[int, ...] = ()) -> None:
        """Admitted on the prompt's bound (`provisional.py`): lower the booked prompt to its exact count, and
        credit its shared texts in tokens, now counted (`text_tokens`)."""
        if self.budget is not None:
            chunks = self._chunks if self._counted(text_tokens) else None
            self.budget.correct_prompt(self.id, prompt_tokens, self.clock(), chunks)
            self.changed(self.pool)

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """While the request waits in its class's queue for its KV: its place in the fleet's order of
        waiting requests (`FleetOrder`), published as it begins and ends."""
        if self.budget is None:
            yield
            return
        order = self.budget.fleet.order
        order.begins(self.id)
        self.changed(self.pool)
        try:
            yield
        finally:
            order.ends(self.id)
            self.changed(self.pool)

    def give_back(self) -> None:
        """Not admitted (refused, or the caller went away while it waited): the booking goes."""
        if self.budget is not None:
            self.budget.release(self.id)
            self.held = False
            self.changed(self.pool)

    def release(self, completion: int | None) -> None:
        """Settled: drop the booking; a completed answer's `completion` teaches the learned ratio."""
        if self.budget is not None:
            self.budget.release(self.id, completion)
            self.held = False
            self.changed(self.pool)

    def when_engine_done(self, callback: Callable[[], None]) -> None:
        """Call `callback` once the pool's feed confirms the engine has finished this request while its
        client still reads (`KvBudget.on_engine_done`); never without a budget, or after the release."""
        if self.budget is not None and self.held:
            self.budget.on_engine_done(self.id, callback)

    def progress(self, streamed_tokens: int, now: float | None) -> None:
        """The inline profile saw `streamed_tokens` completion tokens so far (`now`: a stream's chunk time,
        which also teaches the budget's pace; None for a JSON body that arrives whole)."""
        if self.budget is not None:
            self.budget.progress(self.id, streamed_tokens, now)

    def follow(self, estimated_tokens: int) -> bool:
        """The lean profile's estimate of what the request generated unseen; True if the pool has a budget
        (the caller tells `changed` once per pool per tick, not once per request)."""
        if self.budget is None:
            return False
        self.budget.estimate_progress(self.id, estimated_tokens)
        return True

    def learn_pace(self, first_token_after_s: float, tokens_per_sequence: float, decode_s: float) -> None:
        """A completed stream the budget did not watch (lean) teaches its forecast the pool's pace."""
        if self.budget is not None:
            self.budget.observe_unseen_stream(first_token_after_s, tokens_per_sequence, decode_s)

    def expected_completion(self, allowance: float) -> float:
        """The completion the budget expects of a request allowed `allowance` tokens per sequence (without
        a budget, the whole allowance)."""
        if self.budget is None:
            return allowance
        return self.budget.expected_completion(int(allowance), self.tenant)


class KvGate:
    """A request's KV booking around its tries for a lease: taken for the try at once where it fits
    (`take`), given back if the store refuses (`close`), and taken the moment it fits while the request
    waits in its class's queue (`open`, asked by the queue before each try: `queueing.Gate`). So a request
    the KV budget refused waits for KV as one refused a slot waits for a slot, and a waiting request never
    holds KV that the requests ahead of it need. Each try that does not fit refreshes the request's
    fair-share claim (`fits`), so later, smaller requests of other tenants do not take the KV it waits for.
    `request` is the request without its body (a waiter must not hold megabytes of JSON): its prompt chunks
    were hashed at the first check."""

    __slots__ = ("booking", "fitted", "plan", "request")

    def __init__(self, booking: KvBooking, request: ParsedRequest, plan: Reservation, fitted: bool) -> None:
        self.booking = booking
        self.request = request
        self.plan = plan
        self.fitted = fitted  # the admission's own check found it fits: the first try needs no second one

    def take(self) -> bool:
        """Book it for the try the admission makes at once, where its check found it fits (else False)."""
        if self.fitted:
            self.booking.hold(self.request, self.plan)
        return self.fitted

    def open(self) -> bool:
        if not self.booking.fits(self.request, self.plan)[0]:
            return False
        self.booking.hold(self.request, self.plan)
        return True

    def close(self) -> None:
        self.booking.give_back()
