"""An admitted request until it settles, in either profile: what was seen of its answer, and its one charge.

Each profile hands over what it saw as a `Seen` through one call, `observe`: the inline profile after every
response message, the lean profile once, from the proxy's end report. `settle()` charges the lease from the
last observation (extproc/admission/capacity/charging.py), exactly once, however many paths reach it; a
request admitted on its prompt's bound (`correction`, provisional.py) is charged once its exact count is in.
Where the answer was not seen to its end (nothing of it seen: a client gone before the first byte, a lost
end report; a stream left mid-answer, or cut), the engine ran it at its own pace, whatever its reader, and
the engines' own count is the charge where the feed carries their generation counters (`core.engine_tally`,
through the request's `EngineRun`): the lease gives its slots and KV booking back at once, and settles once
the feed has read the engines past its end (`engine_run.ENGINE_STOP_S`), at most `ENGINE_COUNT_WAIT_S`
later. Where it has no count, the charge is what passed where nothing can have been held back from the
client (`_unheld`), else it includes the pool's decode-rate estimate of what the engine generated; a
completed stream teaches that rate (`learn_pace`, the one place it is learned).

One cut rule (`cut`): a class with `cut_streams_above_kv` is reset while its pool's KV usage is above it.

A request whose engine is done before its client has read the answer gives its slots back early
(`engine_done`, told by its KV booking once the feed confirms it): the slot follows the engine, the tokens
the answer. The feed's pace then is the engine's while it ran the request, kept for its charge
(`estimate_streamed`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace

from extproc.admission.capacity.admitted import Admitted
from extproc.admission.capacity.charging import Ending, ResponseFacts, ending_of, settle_charge
from extproc.admission.deciding import provisional
from extproc.admission.replies import refusals
from extproc.admission.replies.verdicts import Refusal
from extproc.admission.service import AdmissionService
from extproc.admission.tracking.engine_run import EngineRun
from extproc.core.engine.pace import STEPS_PAST_ABORT, PoolPaces, lockstep_floor
from extproc.core.queue.slot_eta import OpenLease

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Seen:
    """What a profile saw of the answer so far.

    `responded`: response headers arrived. `streamed`: the answer is a stream of events. `live`: seen as it
    happens (the inline profile's chunks), so the KV budget follows its progress. `content_since`: the clock
    time of the first content chunk (inline), from which the decode time of an unfinished stream is
    measured. `decode_s`: the time from the first content to the last upstream byte, where it is known (an
    inline stream at its end, the lean end report); `first_token_after_s`: the request's start to its first
    content event (lean), which teaches the KV budget's pace. `passed_bytes`: the answer's bytes that passed
    the proxy (inline: the chunks seen; lean: Envoy's `response_body_bytes`), None where unknown: fewer than
    the proxy buffers for one reader, and nobody held the engine's stream back (`InFlight._unheld`).
    `upstream_s`: the request's start to the last upstream byte (lean), where Envoy tells.
    """

    facts: ResponseFacts
    responded: bool = True
    streamed: bool = False
    live: bool = False
    content_since: float | None = None
    decode_s: float | None = None
    first_token_after_s: float | None = None
    passed_bytes: int | None = None
    upstream_s: float | None = None


NOTHING_SEEN = Seen(ResponseFacts(), responded=False)

NEVER_FORWARDED = Seen(ResponseFacts(forwarded=False), responded=False)
"""What is known of a request the proxy never sent upstream: its admitting reply never reached the proxy (the
transport never took it, or Envoy says its ext_proc message timed out). The filter fails closed
(`failure_mode_allow: false` in every shipped config), so the engine never saw it: settled as
`not_forwarded`, refunded in full, unless a report of what did happen comes first."""

MIN_DECODE_SPAN_S = 0.05
"""The shortest first-to-last-content span that times a decode. A shorter one timed the delivery: the answer
reached the reader in a burst, from a proxy's buffers after a stall (measured on the real-engine tier: 20
tokens within 1-11 ms after 6-12 s held, a "rate" of thousands of tokens per second) or a client's, and
learning it would make every later disconnect of the pool charge its whole reservation."""


def learn_pace(
    rates: PoolPaces,
    admitted: Admitted,
    completion_tokens: int,
    decode_s: float,
    first_token_after_s: float | None = None,
) -> None:
    """A completed stream teaches its pool's decode rate (tokens after the first, per sequence, over the
    time from the first content to the last byte) and, where the first content's delay is known, the KV
    budget's pace: without that a lean sidecar never sees a request progress, and forecast booking falls
    back to booking whole lifetimes."""
    if decode_s < MIN_DECODE_SPAN_S or completion_tokens <= 1:
        return
    request = admitted.request
    tokens = completion_tokens / max(1, request.sequences * request.prompt_count) - 1
    rates.observe(admitted.pool, tokens, decode_s)
    if first_token_after_s is not None:
        admitted.booking.learn_pace(first_token_after_s, tokens, decode_s)


def lockstep(admitted: Admitted, seen: Seen, steps_after: int = 0) -> int:
    """The tokens that passed, as a whole number of steps of all the request's sequences
    (`pace.lockstep_floor`): an answer left or cut mid-way generated each sequence as far; plus
    `steps_after` more of each (`pace.STEPS_PAST_ABORT`), at most the reservation."""
    usage = seen.facts.usage
    request = admitted.request
    sequences = request.sequences * request.prompt_count
    cap = admitted.plan.completion_tokens
    floor = lockstep_floor(usage.completion_tokens if usage is not None else 0, sequences, cap)
    return min(cap, floor + steps_after * max(1, sequences))


class InFlight:
    """One admitted request until its lease settles (see the module docstring)."""

    def __init__(
        self,
        service: AdmissionService,
        admitted: Admitted,
        correction: provisional.Correction | None = None,
    ) -> None:
        self.service = service
        self.admitted = admitted
        self.correction = correction  # admitted on the prompt's bound: its exact count follows
        self.seen = NOTHING_SEEN
        self.settled = False
        self.was_cut = False
        self.ended_at: float | None = None  # lean: when the request ended on the proxy
        self.report_key: str | None = None  # lean: the key the proxy's end report names
        self._forget_report: Callable[[str], None] = lambda _key: None
        self.request_id: str | None = None  # lean: the proxy's x-request-id, only to find an unforwarded one
        self.slot_given_back = False  # the engine was done before the client: its slots went back early
        self.finish_pace: float | None = None  # the feed's pace when it found the engine done with it
        admitted.booking.when_engine_done(self.engine_done)
        request = admitted.request
        sequences = request.sequences * request.prompt_count
        key = admitted.booking.pool  # its budget's: the pool's, or its engine's where a picker named it
        tally = service.deps.engine_tally(key)
        beside = None if key == admitted.pool else service.deps.engine_tally(admitted.pool)
        self.run = EngineRun(tally, admitted.lease.lease_id, admitted.admitted_at, sequences, beside)

    def await_report(self, key: str, forget: Callable[[str], None]) -> None:
        """Lean: the proxy will report this request's end under `key`; `forget` takes it off the registry
        that holds it (extproc/admission/tracking/unseen.py) when it settles, whichever way."""
        self.report_key = key
        self._forget_report = forget

    @property
    def awaiting_report(self) -> bool:
        return self.report_key is not None and not self.settled

    @property
    def known_unforwarded(self) -> bool:
        """Whether what was last seen says the request never went upstream."""
        return not self.seen.facts.forwarded

    def never_forwarded(self) -> None:
        """The request never went upstream (`NEVER_FORWARDED`): settled as such unless something else is
        seen first; in the lean profile an end report naming it overrides this, as it says what happened."""
        if not self.settled and self.seen is NOTHING_SEEN:
            self.seen = NEVER_FORWARDED

    def observe(self, seen: Seen) -> None:
        """Take what was seen of the answer; a stream seen to its end teaches the pool's pace."""
        if self.settled:
            return
        self.seen = seen
        if seen.upstream_s is not None:
            self._upstream_until(self.admitted.admitted_at + seen.upstream_s)
        facts = seen.facts
        usage = facts.usage
        if seen.live and usage is not None:
            # Only a stream's chunks time its progress (a JSON body arrives whole at the end).
            self.admitted.booking.progress(
                usage.completion_tokens, self.service.clock() if seen.streamed else None
            )
        if (
            seen.decode_s is not None
            and seen.streamed
            and facts.completed
            and facts.upstream_status == 200
            and usage is not None
        ):
            learn_pace(
                self.service.paces,
                self.admitted,
                usage.completion_tokens,
                seen.decode_s,
                seen.first_token_after_s,
            )

    def _upstream_until(self, at: float) -> None:
        """Lean: Envoy read the upstream's answer until `at`, past the request's end on the proxy (its client
        left and Envoy read on, so the engine never saw an abort): the engine ran it until then, which its
        count and its run in the tally must cover."""
        at = min(at, self.service.clock())
        if self.ended_at is not None and at > self.ended_at:
            self.ended_at = at
            self.run.ran_until(at)

    def engine_done(self) -> None:
        """The KV feed confirms the engine has finished this request while its client still reads the
        answer (a slow reader, behind the proxy's full buffers): its slots go back now, so the engine's idle
        room admits others; its tokens settle when it ends, from what is seen then, as ever, and the feed's
        pace now, the one it ran at, is kept for that charge (`estimate_streamed`). Once."""
        if self.settled or self.slot_given_back:
            return
        self.slot_given_back = True
        self._end_run()
        service = self.service
        self.finish_pace = service.paces.fed_rate(self.admitted.pool)
        service.settler.release_slot(self.admitted)

    def cut(self) -> Refusal | None:
        """The refusal that resets this stream when its class's KV watermark is passed, else None; at most
        once. The inline profile settles at once; the lean one from the end report, which brings what was
        streamed."""
        if self.settled or self.was_cut:
            return None
        admitted = self.admitted
        threshold = admitted.klass.cut_streams_above_kv
        if threshold is None:
            return None
        usage = self.service.deps.kv_usage(admitted.pool)
        if usage is None or usage <= threshold:
            return None
        self.was_cut = True
        self.service.metrics.streams_cut.labels(admitted.klass.name).inc()
        log.warning(
            "stream cut under KV pressure",
            extra={"class": admitted.klass.name, "model": admitted.model_label},
        )
        return refusals.cut_under_kv_pressure()

    def mark_ended(self) -> None:
        """The request ended on the proxy (its ext_proc stream closed): the estimate stops growing here."""
        if self.ended_at is None:
            self.ended_at = self.service.clock()
        self._end_run()

    def expire(self) -> None:
        """No end report within the bound: settle as `expired`, charged what the engine generated unseen."""
        if not self.settled:
            self._charge_counted(ResponseFacts(expired=True), self.estimate)

    def settle(self) -> None:
        """Charge the lease from what was last seen; only the first call counts. An answer not seen to its
        end that ran at the engine's own pace (nothing of it seen, a stream left before the proxy's
        buffers filled, a cut) is charged the engines' count where the feed has it."""
        if self.settled:
            return
        if self._answer_unseen():
            self._charge_counted(self.seen.facts, self.estimate)
            return
        facts = self._final_facts()
        if self._left_mid_answer(facts):
            self._charge_counted(facts, lambda: facts.estimated_completion)
        else:
            self._charge(facts)

    def _left_mid_answer(self, facts: ResponseFacts) -> bool:
        """A stream that went upstream and ended before its end was seen (left or cut; not an error, which
        keeps its rule), whether or not a reader held its bytes back: the engine ran it at its own pace until
        the abort reached it. A reader never slows an engine: vLLM's output handler puts each step's output
        into the request's collector without waiting, merging it with what the consumer has not taken yet
        (vllm 0.32.0 vllm/v1/engine/output_processor.py, `RequestOutputCollector.put`), so a client slower
        than the engine holds its bytes in the engine's server, not its decoding."""
        ending = ending_of(facts)
        return ending is Ending.CUT or (ending is Ending.ABORTED and self.seen.streamed)

    def _answer_unseen(self) -> bool:
        """Whether the request went upstream and nothing of its answer came back (no response started):
        what the engine generated for it passed nobody."""
        seen = self.seen
        facts = seen.facts
        cut = self.was_cut and seen is not NOTHING_SEEN
        return not cut and not facts.completed and facts.forwarded and not seen.responded

    def _charge_counted(self, facts: ResponseFacts, estimate: Callable[[], int]) -> None:
        """Charge an answer not seen to its end what the engines counted for it where the feed carries
        their counters and reaches back to its admission (`engine_run.EngineRun`), else `estimate()`
        (the pace, or what passed by the rules of `_final_facts`). Counted: its slots and KV booking go back
        now (the engine stops within a step of the end), the charge once the feed has read past the end."""
        admitted = self.admitted
        if not self.run.countable():
            self._count_basis("estimate")
            self._charge(replace(facts, estimated_completion=estimate()))
            return
        stop = self._until()
        self._close()
        admitted.booking.release(None)
        self.service.settler.release_slot(admitted, early=False)
        count = self.run.count(self.run.stopped_at(stop), admitted.plan.completion_tokens)
        self.service.track(asyncio.ensure_future(self._book_counted(facts, estimate, count)))

    async def _book_counted(
        self, facts: ResponseFacts, estimate: Callable[[], int], count: Awaitable[float | None]
    ) -> None:
        charge = self.run.charge(await count, facts.usage, self.admitted.plan.completion_tokens)
        self._count_basis("estimate" if charge is None else "engine_count")
        if charge is None:
            self._book_or_correct(replace(facts, estimated_completion=estimate()))
            return
        if self.run.ran_on_charged > 0:
            metrics, ran_on = self.service.metrics, self.run.ran_on_charged
            self.service.settler.child(metrics.tokens_run_on, self.admitted.model_label).inc(ran_on)
        self._book_or_correct(replace(facts, counted_completion=charge))

    def _count_basis(self, basis: str) -> None:
        service = self.service
        service.settler.child(service.metrics.unfinished_answers, self.admitted.model_label, basis).inc()

    def _final_facts(self) -> ResponseFacts:
        seen = self.seen
        facts = seen.facts
        if self.was_cut and seen is not NOTHING_SEEN:
            return replace(facts, cut=True, estimated_completion=lockstep(self.admitted, self.seen))
        if facts.completed or not facts.forwarded:
            return facts
        if self._unheld(seen):
            return replace(facts, estimated_completion=lockstep(self.admitted, self.seen, STEPS_PAST_ABORT))
        decoding = seen.decode_s
        if decoding is None and seen.content_since is not None:
            decoding = self._until() - seen.content_since
        streamed = self.estimate_streamed(decoding) or 0
        return replace(facts, estimated_completion=max(streamed, lockstep(self.admitted, self.seen)))

    def _unheld(self, seen: Seen) -> bool:
        """Whether a stream not seen to its end ran at the engine's own pace to the last: fewer of its bytes
        passed the proxy than the proxy buffers for one reader (`admission.proxy_buffer_bytes`), so no reader
        can have held the engine's stream back, and every token the engine sent before the client left
        passed here and was counted. A pace over the stream's time would charge the pace of other answers
        (single ones, where eight sequences decoded together each ran at a fifth to a half of it on a CPU
        engine), so the tokens that passed are the charge, with the step the abort lets finish."""
        passed = seen.passed_bytes
        return seen.streamed and passed is not None and passed < self.service.rules().proxy_buffer_bytes

    def _charge(self, facts: ResponseFacts) -> None:
        self._close()
        self._book_or_correct(facts)

    def _close(self) -> None:
        """Settled from here on, whatever follows: booked on the first attempt, whatever the store answers
        (a shared store answers False for a lease that already expired there, and the request still ended
        here), and no longer awaiting a report."""
        self._end_run()
        self.settled = True
        if self.report_key is not None:
            self._forget_report(self.report_key)

    def _end_run(self) -> None:
        self.run.end(self._until())

    def _book_or_correct(self, facts: ResponseFacts) -> None:
        correction = self.correction
        if correction is not None and correction.defer(functools.partial(self._book, facts)):
            self.start_correction()
            return  # admitted on a bound: settled with the exact count once it is in (provisional.py)
        self._book(facts, self.admitted)

    def _book(self, facts: ResponseFacts, admitted: Admitted) -> None:
        weight = self.service.rules().cached_prompt_token_weight
        self.service.settler.settle(admitted, settle_charge(admitted.plan.prompt_tokens, facts, weight))

    def start_correction(self) -> None:
        """Count a bound admission exactly: once the proxy has its verdict, or once it settles if that is
        sooner (its settlement waits for the count). Idempotent; nothing without a correction."""
        if self.correction is not None:
            self.correction.start(self.admitted, self._corrected)

    def _corrected(self, admitted: Admitted) -> None:
        self.admitted = admitted

    def _until(self) -> float:
        return self.ended_at if self.ended_at is not None else self.service.clock()

    def estimate(self) -> int:
        """Completion tokens the backend may have generated unseen: the pool's decode rate over the time
        from admission to the end of the request (or to now), capped by the reservation."""
        admitted = self.admitted
        request = admitted.request
        return self.service.paces.estimate(
            admitted.pool,
            self._until() - admitted.admitted_at,
            request.sequences * request.prompt_count,
            admitted.plan.completion_tokens,
        )

    def estimate_streamed(self, decoding_s: float | None) -> int | None:
        """What the engine generated for an answer seen streaming but not to its end: its pace over
        `decoding_s` since the first token (one token each before it), capped by the reservation. The pace
        is the larger of the learned one and the feed's, kept from when the feed found the engine done with
        this request where it did (`PoolPaces.streamed_pace`): the learned one is a delivery pace, the
        inline profile timing chunks as the proxy hands them over, below the engine's on a busy host (a
        third of it in one CI run). None without a pace: the tokens that passed are then the only
        evidence."""
        rates = self.service.paces
        admitted = self.admitted
        pace = rates.streamed_pace(admitted.pool, self.finish_pace)
        if decoding_s is None or pace is None:
            return None
        request = admitted.request
        sequences = request.sequences * request.prompt_count
        cap = admitted.plan.completion_tokens
        return min(cap, sequences + rates.estimate(admitted.pool, decoding_s, sequences, cap, rate=pace))

    def open_lease(self, key: str) -> OpenLease | None:
        """This request as an open lease on `key` (for slot retry hints), or None if it holds none there."""
        return open_lease_of(self, key)


def open_lease_of(inflight: InFlight, key: str) -> OpenLease | None:
    """`inflight` as an open lease on `key` (`InFlight.open_lease`)."""
    admitted = inflight.admitted
    if inflight.settled or inflight.slot_given_back or key not in admitted.lease.keys:
        return None
    usage = inflight.seen.facts.usage
    request = admitted.request
    sequences = max(1, request.sequences * request.prompt_count)
    allowance = admitted.plan.completion_tokens / sequences
    service = inflight.service
    rate = service.paces.hint_rate(admitted.pool)
    if usage is not None:
        streamed = usage.completion_tokens / sequences
    else:
        # Nothing seen (the lean profile until the end report, a JSON answer): the engine has been
        # generating since admission at the pool's rate, as the KV forecast reckons unseen progress.
        streamed = (service.clock() - admitted.admitted_at) * rate
    return OpenLease(
        expected_tokens=admitted.booking.expected_completion(allowance),
        streamed_tokens=streamed,
        rate=rate,
        ended=inflight.ended_at is not None,
    )
