"""How fast a pool generates, per sequence: the one pace idea of the sidecar, and the bound used to charge
answers nobody saw.

Three paces, one rule to read them by (`usable_rate`):
- learned (`LearnedPace`): what this sidecar saw streams complete at, an exponentially weighted mean of
  their per-sequence rates and first-token delays. Each pool's KV budget keeps one for its forecast
  (`extproc.core.kv.pacing.BudgetPace`) and `PoolPaces` one per pool for charges and hints: the same type,
  two instances, because their samples differ (below);
- fed: the engines' own pace, measured on the feed's side from two scrapes of their generation counters
  (`extproc.kvfeed.pace.EnginePaceMeter`), read here through `usable_rate`;
- assumed: the configured `admission.assumed_decode_tokens_per_second`.
Where the learned and the fed pace both exist, a forecast or a hint takes the slower (`bounded_by_engines`,
`hint_pace`): the rule the KV budget and the retry hints share.

The two learned paces stay apart because merging them would change numbers: `PoolPaces` takes a sample at
most `max_step` times its current rate (below), the budget's forecast takes it as it is; and in the inline
profile the budget learns from the chunk times it watched when a lease is released (completed or not),
while `PoolPaces` learns from completed 200 answers whose first-to-last span is at least
`MIN_DECODE_SPAN_S` (`admission.tracking.inflight.learn_pace`). In the lean profile one end report feeds
both, once each.

A request can end before any response byte arrived (a non-streamed answer whose client left after three
seconds, or a lease whose end signal never came). The backend still generated tokens until it noticed:
charging the prompt alone would let a client run long generations for free by disconnecting. The charge is
instead `min(reserved completion, elapsed x decode rate x sequences)`, with the pool's per-sequence decode
rate learned from its completed streamed answers (tokens after the first, over the time between the first
and the last chunk) as an exponentially weighted mean. A sample is taken at most `max_step` times the rate
the pool has now (learned, else fed, else assumed): an answer delivered faster than it was decoded (part of it
held in a proxy's buffers, then sent at once) cannot multiply the charge of the pool's next disconnects, and
a pool that really is faster gets there within a few samples.

Which rate `rate(pool)` gives, first that exists:
1. learned: from the pool's own completed streams here (what this sidecar saw end to end);
2. fed: the engines' own pace from the KV feed (`fed(pool)`, their generation-token counters per running
   sequence between scrapes, `extproc.kvfeed.pace`), while the pool has no learned rate: a sidecar whose end
   reports never arrive (the lean profile with Envoy's access log down) never completes a stream, and
   without the feed would charge every expired lease at the assumption;
3. assumed: `default_tokens_per_second` (`admission.assumed_decode_tokens_per_second`).

Elapsed time includes queueing and prefill, so the charge errs high, never above the reservation.

The same estimate bounds a stream that was seen but not to its end past the proxy's buffer (a slow reader
the proxy cut at the request's lifetime bound, a client gone mid-answer; before it nothing held the engine
back, and what passed is the charge, `STEPS_PAST_ABORT` more of each sequence): the engine kept generating
at its own pace whatever the client read, so such a stream is charged at least the larger of the learned
rate and the fed pace (`streamed_pace`) over the time since its first token, never the configured
assumption (no evidence): a rate learned from the inline profile's chunks is a delivery pace, below the
engine's on a busy host.
Pure: no clock; callers pass durations (`fed` reads the feed's newest aggregate).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum

FedRate = Callable[[str], float | None]


class RateSource(StrEnum):
    """Where `PoolPaces.rate` took a pool's rate from, in the order it looks."""

    LEARNED = "learned"
    FED = "fed"
    ASSUMED = "assumed"


def _no_feed(pool: str) -> float | None:
    return None


def usable_rate(tokens_per_second: float | None) -> float | None:
    """A pace as a rate, None where it is none (unknown, 0, NaN, inf): the sidecar's one validity rule for
    a pace it did not learn (the feed's, the configured assumption). A feed sends these when an engine
    generated nothing between two scrapes, or with a reading no engine can have. The feed's side bounds
    what it sends by its own rule too (`extproc.kvfeed.pace.plausible_pace`, which also caps it): that
    package imports nothing of the core, so the wire keeps its own check and this one reads what arrives."""
    ok = tokens_per_second is not None and math.isfinite(tokens_per_second) and tokens_per_second > 0.0
    return tokens_per_second if ok else None


def bounded_by_engines(learned: float | None, fed: float | None) -> float | None:
    """The learned pace, or the engines' current one where that is slower; None while none is learned. A
    pace learned at low load (a warm-up, the first streams after a start) runs fast under a full batch,
    and forecasts and hints taken at it expect answers to end sooner than they do."""
    if learned is None or fed is None:
        return learned
    return min(learned, fed)


def hint_pace(learned: float | None, fed: float | None, assumed: float | None) -> float | None:
    """The pace a retry hint forecasts open requests to end at: `bounded_by_engines`, else the engines'
    pace, else the assumed one; None with none of them. A hint late by a little costs a client that much,
    one early costs it a retry."""
    for pace in (bounded_by_engines(learned, fed), fed, assumed):
        if pace is not None:
            return pace
    return None


@dataclass
class LearnedPace:
    """How fast one pool decodes per sequence, and how long an admitted request waits for its first token,
    as learned from the streams this sidecar saw complete: exponentially weighted means, so the progress of
    requests that cannot be observed (plain JSON answers, the lean profile's unseen ones) can be estimated
    from the time since their admission. Unknown (None) until the first sample: callers then book
    conservatively, or fall back to the engines' or the assumed pace, instead of guessing."""

    alpha: float = 0.2
    min_tokens: int = 16  # shorter streams carry too much chunk-timing noise to be a rate sample
    _rate: float | None = None
    _delay: float | None = None

    def __post_init__(self) -> None:
        if not 0.0 < self.alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {self.alpha}")

    @property
    def tokens_per_second(self) -> float | None:
        """Tokens one sequence decodes per second, None until observed."""
        return self._rate

    @property
    def first_token_delay(self) -> float:
        """Seconds from admission to the first token (queueing + prefill); 0 until observed."""
        return self._delay or 0.0

    def observe_first_token(self, seconds: float) -> None:
        """A request's first token came `seconds` after its admission."""
        if seconds >= 0 and math.isfinite(seconds):
            self._delay = self._mix(self._delay, seconds)

    def observe_stream(self, tokens_per_sequence: float, seconds: float, ceiling: float = math.inf) -> None:
        """A stream produced `tokens_per_sequence` tokens per sequence in `seconds` after its first one; the
        sample is taken at most at `ceiling` (`PoolPaces.max_step`: a burst a proxy held is no pace)."""
        if tokens_per_sequence < self.min_tokens or not (seconds > 0 and math.isfinite(seconds)):
            return
        self._rate = self._mix(self._rate, min(tokens_per_sequence / seconds, ceiling))

    def tokens_since(self, admitted_at: float, now: float, sequences: int) -> float | None:
        """Tokens a request admitted at `admitted_at` has probably generated by `now`; None while unknown."""
        if self._rate is None:
            return None
        running = now - admitted_at - self.first_token_delay
        return max(0.0, running) * self._rate * max(1, sequences)

    def _mix(self, old: float | None, sample: float) -> float:
        return sample if old is None else (1 - self.alpha) * old + self.alpha * sample


STEPS_PAST_ABORT = 1
"""The engine steps that still count for every sequence of a stream after its client left: vLLM 0.32's
engine core takes aborts between steps (vllm/v1/engine/core.py, `run_busy_loop`: `_process_input_queue`,
then `_process_engine_step`), so the step running when the abort arrives completes and its token is
generated; one the proxy never passed. Measured on the real-engine tier: 0 to 1.9 tokens a stream beyond
what passed (tests/engine/test_charges_engine.py)."""


def lockstep_floor(seen: int, sequences: int, cap: int) -> int:
    """The least an engine generated for `sequences` sampled together (`n`, `best_of`, several prompts) of
    which `seen` tokens passed, at most `cap`: every sequence advanced as far as the ones seen furthest, so
    the count rounds up to a whole number of steps for all. vLLM 0.32 fans `n` out into child requests added
    to the engine together (vllm/v1/engine/async_llm.py, `add_request`: "Fan out child requests") and decodes
    them in the same batches; a stream left after the first step's events for some of them had generated the
    first token of every one. Where some sequences ended early the rounding adds fewer than `sequences`."""
    if seen <= 0 or sequences <= 1:
        return max(0, min(seen, cap))
    return min(cap, -(-seen // sequences) * sequences)


@dataclass
class PoolPaces:
    """Every pool's pace as admission reads it (module docstring): what settlement charges an answer nobody
    saw with, what a retry hint forecasts and what a decision expects an answer to take; learned (one
    `LearnedPace` per pool, each sample at most `max_step` times the pool's rate now), else fed, else
    assumed."""

    default_tokens_per_second: float = 100.0
    alpha: float = 0.2
    min_tokens: int = 16  # shorter answers carry too much timing noise to be a sample
    max_step: float = 4.0  # a sample counts at most this many times the current rate
    fed: FedRate = _no_feed  # the pool's pace from the KV feed, None without a fresh one
    _learned: dict[str, LearnedPace] = field(default_factory=dict, init=False)

    def rate(self, pool: str) -> float:
        """Tokens per second per sequence of the pool: learned, else fed, else assumed (see above)."""
        return self.rate_and_source(pool)[0]

    def source(self, pool: str) -> RateSource:
        """Which of the three the pool's rate is now (tests and logs tell a fed charge from a guess)."""
        return self.rate_and_source(pool)[1]

    def rate_and_source(self, pool: str) -> tuple[float, RateSource]:
        """The rate and where it came from; a fed value that is no pace (0, NaN, inf) is not taken."""
        learned = self._learned_rate(pool)
        if learned is not None:
            return learned, RateSource.LEARNED
        fed = usable_rate(self.fed(pool))
        if fed is not None:
            return fed, RateSource.FED
        return self.default_tokens_per_second, RateSource.ASSUMED

    def hint_rate(self, pool: str) -> float:
        """The pace a retry hint forecasts open requests to end at (`slot_eta`): `hint_pace`, as the KV
        budget's hints take it (`KvBudget.hint_rate`), the assumption being this one's default. Hints at a
        pace learned at low load send refused clients back before anything frees: the `openai` SDK spends
        its retries in the first seconds and gives up."""
        pace = hint_pace(self._learned_rate(pool), self.fed_rate(pool), self.default_tokens_per_second)
        return pace if pace is not None else self.default_tokens_per_second

    def observe(self, pool: str, tokens_per_sequence: float, seconds: float) -> None:
        """A completed streamed answer: `tokens_per_sequence` tokens after the first, over `seconds`."""
        learned = self._learned.get(pool)
        if learned is None:
            learned = self._learned[pool] = LearnedPace(self.alpha, self.min_tokens)
        learned.observe_stream(tokens_per_sequence, seconds, ceiling=self.max_step * self.rate(pool))

    def fed_rate(self, pool: str) -> float | None:
        """The engines' own pace from the KV feed, None where there is none (see `usable_rate`)."""
        return usable_rate(self.fed(pool))

    def streamed_pace(self, pool: str, fed: float | None = None) -> float | None:
        """The pace of a stream seen but not to its end (module docstring): the larger of the learned rate
        and the fed pace (`fed` where the caller kept one, else the feed's now); None with neither."""
        if fed is None:
            fed = self.fed_rate(pool)
        paces = [pace for pace in (self._learned_rate(pool), fed) if pace is not None]
        return max(paces) if paces else None

    def learned(self, pool: str) -> bool:
        """Whether the pool's rate was learned from its own streams (else `rate` is fed or assumed)."""
        return self._learned_rate(pool) is not None

    def estimate(
        self, pool: str, elapsed_s: float, sequences: int, cap: int, rate: float | None = None
    ) -> int:
        """Tokens the pool may have generated for a request in `elapsed_s` at `rate` (default: `rate(pool)`),
        at most `cap`."""
        if elapsed_s <= 0 or cap <= 0:
            return 0
        pace = rate if rate is not None else self.rate(pool)
        return min(cap, math.ceil(elapsed_s * pace * max(1, sequences)))

    @property
    def pools(self) -> int:
        """The pools with a learned rate."""
        return sum(1 for learned in self._learned.values() if learned.tokens_per_second is not None)

    def _learned_rate(self, pool: str) -> float | None:
        learned = self._learned.get(pool)
        return learned.tokens_per_second if learned is not None else None
