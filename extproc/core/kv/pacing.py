"""The paces one pool's KV budget reads (`KvBudget`): the decode pace its forecast takes unseen answers to
progress at, the one a refusal's `retry-after` is forecast at, and how long after admission a lease is in
the engine's gauges. Learned from the streams the budget watches (its own `LearnedPace`, apart from the
one `PoolPaces` charges with: `extproc.core.engine.pace` says why), bounded by the engines' own pace from
the feed, and, for hints only, an assumed pace where neither is known: the rules `bounded_by_engines` and
`hint_pace` that admission's hints share.

Pure: no clock, no I/O.
"""

from __future__ import annotations

from extproc.core.engine.pace import LearnedPace, bounded_by_engines, hint_pace, usable_rate
from extproc.core.kv.lease import Lease

SETTLE_AFTER_S = 2.0
"""The least time after admission for a lease to count as held in the engine's gauge (`settle_after`)."""


class BudgetPace:
    """One pool's paces, as its budget's forecast, corrections and hints read them."""

    def __init__(self, pace: LearnedPace | None = None) -> None:
        self.learned = pace or LearnedPace()
        self._fed_rate: float | None = None
        self._assumed_rate: float | None = None  # the pace hints take with no other (`assume_pace`)

    def forecast(self) -> tuple[float | None, float]:
        """The pace and the first-token delay a lease's trajectory is forecast with (`Lease.trajectory`)."""
        return self.decode_rate(), self.learned.first_token_delay

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
            self.learned.observe_stream(tokens, lease.last_progress_at - first_at)

    def observe_unseen_stream(
        self, first_token_after_s: float, tokens_per_sequence: float, seconds: float
    ) -> None:
        """A completed stream this budget did not watch (the lean profile reports it when it ends): its
        first-token delay and its decode rate teach the pool's pace, as a watched stream does on release."""
        self.learned.observe_first_token(first_token_after_s)
        self.learned.observe_stream(tokens_per_sequence, seconds)

    def observe_fed_pace(self, tokens_per_second: float | None) -> None:
        """The engine's own decode pace per sequence at the last sample (measured from its counters on the
        feed's side, `kvfeed.pace.EnginePaceMeter`), None when unknown: it bounds the learned pace from above
        (`decode_rate`)."""
        self._fed_rate = usable_rate(tokens_per_second)

    def decode_rate(self) -> float | None:
        """The pace the forecast takes unseen answers to progress at: the one learned from finished streams,
        or the engine's current one where that is slower. A pace learned from a stream decoded at low load
        runs fast under a full batch; taken as it is, it has admitted answers look further along, and so
        ending sooner, than they are (a burst of forty let in on a pace learned from one warm-up stream
        took the cache to 0.98). A slower pace only makes the forecast keep KV longer. None while none is
        learned: such leases book their whole footprint, as before."""
        return bounded_by_engines(self.learned.tokens_per_second, self._fed_rate)

    def assume_pace(self, tokens_per_second: float | None) -> None:
        """The pace a refusal's `retry-after` is forecast at where neither a learned nor a fed one exists
        (`admission.assumed_decode_tokens_per_second`): hints only, never what is booked."""
        self._assumed_rate = usable_rate(tokens_per_second)

    def hint_rate(self) -> float | None:
        """The pace a refusal's `retry-after` is forecast at: the forecast's own (`decode_rate`), else the
        engines' pace from the feed, else the assumed one; None with none of them.

        Before a stream has shown a pace the forecast has none (its unseen leases book their whole footprint,
        the safe side), but a hint still needs one: without it the first burst after a start was told a flat
        second while the answers it waited for ran four (the `openai` SDK's two retries spent before
        anything freed: 7 of 40 answered on vLLM). The feed's pace is the engines' own under the batch they
        run now, what the leases will end at."""
        return hint_pace(self.learned.tokens_per_second, self._fed_rate, self._assumed_rate)

    def settle_after(self) -> float:
        """Seconds after admission past which a lease is taken to be in the engine's KV gauge when nothing
        waits there: twice the pool's learned first-token delay, at least 2 s (the request's transfer, the
        engine's tokenizing and a scrape's age)."""
        return max(SETTLE_AFTER_S, 2.0 * self.learned.first_token_delay)
