"""The paces one pool's KV budget reads (`KvBudget`): the decode pace its forecast takes unseen answers to
progress at, the one a refusal's `retry-after` is forecast at, and how long after admission a lease is in
the engine's gauges. Learned from the streams the budget watches (its own `LearnedPace`, apart from the
one `PoolPaces` charges with: `extproc.core.engine.pace` says why), bounded by the engines' own pace from
the feed, and, for hints only, an assumed pace where neither is known: the rules `bounded_by_engines` and
`hint_pace` that admission's hints share.

Pure: no clock, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

from extproc.core.engine.pace import LearnedPace, bounded_by_engines, hint_pace, usable_rate
from extproc.core.engine.steps import StepTimes
from extproc.core.kv.lease import Lease

SETTLE_AFTER_S = 2.0
"""The least time after admission for a lease to count as held in the engine's gauge (`settle_after`)."""


class BudgetPace:
    """One pool's paces, as its budget's forecast, corrections and hints read them."""

    def __init__(
        self, pace: LearnedPace | None = None, booked_sequences: Callable[[], int] | None = None
    ) -> None:
        self.learned = pace or LearnedPace()
        self._fed_rate: float | None = None
        self._fed_batch: float | None = None  # the engines' running sequences its reading was taken at
        self._learned_batch: float | None = None  # the same for the learned pace, a mean as the pace is
        self._running: float | None = None  # the engines' running sequences at the last sample
        self._booked_sequences = booked_sequences or (lambda: 0)  # this replica's leases' sequences
        self._assumed_rate: float | None = None  # the pace hints take with no other (`assume_pace`)
        self._steps = StepTimes()  # the engines' step time against their batch, from the fed paces

    def forecast(self) -> tuple[float | None, float]:
        """The pace and the first-token delay a lease's trajectory is forecast with (`Lease.trajectory`):
        when each lease ends, and so the peak (`decode_rate`)."""
        return self.decode_rate(), self.learned.first_token_delay

    def progress(self) -> tuple[float | None, float]:
        """The pace and the first-token delay the KV a lease holds now is estimated with, against the
        engine's gauge (`correction.py`): the pace read, not taken down to the batch as the forecast's is.
        What the engine holds beyond the leases' estimate is added to every forecast, so an estimate taken
        slow there booked the answers' progress twice: a burst of thirty-one chats booked 1.33 of the cache
        while the engine held 0.83."""
        rate = bounded_by_engines(self.learned.tokens_per_second, self._fed_rate)
        return rate, self.learned.first_token_delay

    def streamed(self, lease: Lease, now: float) -> None:
        """`lease` streamed at `now`: its first token teaches the first-token delay."""
        if lease.first_progress is None:
            lease.first_progress = (now, lease.streamed)
            if lease.admitted_at is not None:
                self.learned.observe_first_token(now - lease.admitted_at)
        lease.last_progress_at = now

    def learn(self, lease: Lease) -> None:
        """A released lease whose answer streamed teaches the decode pace."""
        if lease.first_progress is not None and lease.last_progress_at is not None:
            first_at, first_count = lease.first_progress
            tokens = (lease.streamed - first_count) / lease.sequences
            self._learn_stream(tokens, lease.last_progress_at - first_at)

    def observe_unseen_stream(
        self, first_token_after_s: float, tokens_per_sequence: float, seconds: float
    ) -> None:
        """A completed stream this budget did not watch (the lean profile reports it when it ends): its
        first-token delay and its decode rate teach the pool's pace, as a watched stream does on release."""
        self.learned.observe_first_token(first_token_after_s)
        self._learn_stream(tokens_per_sequence, seconds)

    def _learn_stream(self, tokens_per_sequence: float, seconds: float) -> None:
        """A stream's pace taught, with the batch it ran in: the engines' running sequences at the last
        sample (at least one), mixed as the pace is (`_at_batch` says why); unknown where the
        engines publish no running count."""
        before = self.learned.tokens_per_second
        self.learned.observe_stream(tokens_per_sequence, seconds)
        if self.learned.tokens_per_second == before or self._running is None:
            return
        batch, old = max(1.0, self._running), self._learned_batch
        self._learned_batch = (
            batch if old is None else (1 - self.learned.alpha) * old + self.learned.alpha * batch
        )

    def observe_fed_pace(self, tokens_per_second: float | None, running: float | None = None) -> None:
        """The engine's own decode pace per sequence at the last sample (measured from its counters on the
        feed's side, `kvfeed.pace.EnginePaceMeter`), None when unknown, and the sequences the engines ran
        then: it bounds the learned pace from above (`decode_rate`). The feed sends its last reading again
        until a new one closes, so a new value is a new reading, taken at about this running count."""
        rate = usable_rate(tokens_per_second)
        if rate != self._fed_rate:
            usable = running is not None and math.isfinite(running) and running > 0.0
            self._fed_batch = running if usable else None
            if rate is not None and running is not None and usable:
                self._steps.observe(rate, running)
        self._fed_rate = rate
        if running is not None and math.isfinite(running):
            self._running = max(0.0, running)

    def decode_rate(self) -> float | None:
        """The pace the forecast takes unseen answers to progress at: the one learned from finished streams,
        or the engine's where that is slower. A pace learned from a stream decoded at low load runs fast
        under a full batch; taken as it is, it has admitted answers look further along, and so ending
        sooner, than they are (a burst of forty let in on a pace learned from one warm-up stream took the
        cache to 0.98). A slower pace only makes the forecast keep KV longer. None while none is learned:
        such leases book their whole footprint, as before.

        The engines' pace is read at the batch the leases will run in (`_at_batch`), and so is the learned
        one where the feed has read none: a burst admitted into an idle engine runs at a fraction of the
        pace the engine showed alone, and the feed reads the new batch's pace only a window (a second or
        more) after it formed. Meanwhile, at the pace read alone, thirty-seven chats admitted over two
        seconds on the real-engine tier's vLLM were forecast to end in turn while they ran together: booked
        1.11 of the cache at their peak, the engine's KV at 0.98; thirty-eight on the pace learned from one
        warm-up stream (too short for the feed to read), 1 preemption. Once the feed has read the batch's
        own pace, the learned one only bounds it from above, as before: scaled too, a pace learned alone
        stayed a thirtieth of the batch's until streams of the batch had taught it."""
        fed = self._at_batch(self._fed_rate, self._fed_batch)
        learned = self.learned.tokens_per_second
        if fed is None:
            learned = self._at_batch(learned, self._learned_batch)
        return bounded_by_engines(learned, fed)

    def _at_batch(self, rate: float | None, read_at: float | None) -> float | None:
        """A pace read at `read_at` running sequences, at the batch the leases will run in: the sequences
        running at the last sample or, where more, those this replica's leases hold. Past the batch it was
        read at, scaled down by the ratio, the least it can be where a step takes at most in proportion to
        its batch (a decode step's time grows with its batch from a fixed part: on a GPU far less than in
        proportion, so this errs slow, keeping KV longer, until the feed reads the new batch's pace)."""
        if rate is None or read_at is None:
            return rate
        batch = self._batch()
        return rate * read_at / batch if batch > read_at else rate

    def _batch(self) -> float:
        """The batch the leases run in: the sequences running at the last sample or, where more, those this
        replica's leases hold."""
        return max(self._running or 0.0, float(self._booked_sequences()))

    def assume_pace(self, tokens_per_second: float | None) -> None:
        """The pace a refusal's `retry-after` is forecast at where neither a learned nor a fed one exists
        (`admission.assumed_decode_tokens_per_second`): hints only, never what is booked."""
        self._assumed_rate = usable_rate(tokens_per_second)

    def hint_rate(self) -> float | None:
        """The pace a refusal's `retry-after` is forecast at: the engines' step times fitted against their
        batch (`StepTimes`), at the batch the leases run in now, once paces at two batch sizes have been
        read; else the one the leases are taken to progress at (`progress`: read, not taken down to the
        batch as the forecast's peak is, since a hint late by the scaling costs every refused client that
        wait), else the engines' pace from the feed, else the assumed one; None with none of them.

        The feed's pace is the last one read, held while the engines drain: read at another batch, it is
        off by the ratio of their step times: a pace held from a batch of forty-eight (16.8 tokens/s) told
        a burst's refused clients 17.9 s where its first wave of thirty-two ended at 10.3-10.9 s (the
        real-engine tier's shared-prefix overload, `steps.py`). A learned pace is a mean over the streams'
        batches, which the fit reads no better.

        Before a stream has shown a pace the forecast has none (its unseen leases book their whole footprint,
        the safe side), but a hint still needs one: without it the first burst after a start was told a flat
        second while the answers it waited for ran four (the `openai` SDK's two retries spent before
        anything freed: 7 of 40 answered on vLLM). The feed's pace is the engines' own under the batch they
        run now, what the leases will end at."""
        fitted = self._steps.pace_at(self._batch())
        if fitted is not None:
            return fitted
        return hint_pace(self.learned.tokens_per_second, self._fed_rate, self._assumed_rate)

    def releases(self, leases: Iterable[Lease], now: float) -> list[tuple[float, int]] | None:
        """When each of `leases` is expected to free its footprint (seconds from `now`, tokens), at the pace
        hints take: what a refusal's `retry-after` plans on, and the others are told (`ReplicaShare.frees`);
        None with no pace."""
        rate = self.hint_rate()
        if rate is None or rate <= 0:
            return None
        delay = self.learned.first_token_delay
        return [(lease.seconds_left(now, rate, delay), lease.footprint) for lease in leases]

    def settle_after(self) -> float:
        """Seconds after admission past which a lease is taken to be in the engine's KV gauge when nothing
        waits there: twice the pool's learned first-token delay, at least 2 s (the request's transfer, the
        engine's tokenizing and a scrape's age)."""
        return max(SETTLE_AFTER_S, 2.0 * self.learned.first_token_delay)
