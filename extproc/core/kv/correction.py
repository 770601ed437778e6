"""The KV budget's engine corrections (`KvBudget.observe_engine`): what a feed sample of the engine's own
gauges changes in what one pool's leases are booked for. The engine's gauge wins where the two disagree, in
both directions, until the next sample: KV in use that the leases do not explain is added to every forecast,
what settled leases are provably booked for beyond the KV in use is taken off, and leases the engine has
finished while their clients still read are booked nothing (and, once confirmed over samples, whoever asked
is told). With the other replicas' figures (`Fleet`) the pool's gauges are read against every replica's
leases; this replica's own figures for them are computed here too (`replica_share`).

Pure: no clock, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from extproc.core.engine.done import EngineDone
from extproc.core.kv.booked import Booker
from extproc.core.kv.fleet import ReplicaShare, frees_by
from extproc.core.kv.lease import Lease
from extproc.core.kv.ledger import Ledger
from extproc.core.kv.pacing import BudgetPace
from extproc.core.kv.pool_share import PoolShare
from extproc.core.kv.prefill import PrefillEvidence


class EngineCorrection:
    """What the engine's samples correct in one pool's booking (`KvBudget.observe_engine`)."""

    def __init__(self, ledger: Ledger, booker: Booker, pace: BudgetPace, share: PoolShare) -> None:
        self._ledger = ledger
        self._booker = booker
        self._pace = pace
        self._share = share
        self._engine_done = EngineDone()  # who is told once the engine is confirmed done with a lease
        self._prefill = PrefillEvidence()  # which leases the engines' prompt counter says are prefilled

    def observe(
        self,
        used_tokens: float | None,
        now: float,
        fresh_for: float,
        waiting: float | None,
        running: float | None,
        prompted: float | None = None,
    ) -> None:
        """A fresh engine sample: KV tokens in use now (None when not published), trusted `fresh_for` s, the
        requests waiting in the engine's queue and those running (None when not published), and the prompt
        tokens the pool's engines have prefilled, a counter (None when not published: `PrefillEvidence`).

        The engine's gauge wins where the two disagree, in both directions, until the next sample:

        * KV in use (this sidecar's share of it) beyond what every lease's current KV explains (other
          traffic, progress under-estimated) is added to every forecast;
        * KV the settled leases provably do not hold is taken off: when nothing waits in the engine, every
          lease admitted more than `settle_after` ago is running there and holds its blocks, so those leases
          hold at most the KV in use, once each is prefilled: where the engines count prefilled prompts, only
          leases whose prompt the count has grown by since their admission count (a long prompt in chunked
          prefill runs with only its first chunks in the cache). Their prompts (less shared prefixes) and the
          tokens seen streamed are a floor of what they hold while they run, and of what they will hold until
          they end; booked beyond the KV in use, that floor is over-booked for the rest of their lives (a
          prefix shared that the chunks missed, prompts the engine's tokenizer makes shorter, an answer the
          engine finished while its client still reads). Estimated progress and block rounding are left out:
          taking an over-estimate of either off would lower the forecast of each lease's final size, which
          does not depend on them. Leases admitted since may not be in the gauge yet (they count as holding
          nothing); a request waiting (queued, or preempted and waiting to resume) holds nothing now but needs
          its KV back, so with anything waiting nothing is taken off.
        * Leases the engine has finished are booked nothing until the next sample (`_engine_finished`): an
          answer the engine generated whole while its client still reads it (a slow reader in the lean
          profile, whose lease ends with the proxy's report) holds no KV there. Once that finding holds
          over samples, whoever asked (`on_engine_done`) is told, at the end of this call.
        """
        booker = self._booker
        booker.fresh_until = now + max(0.0, fresh_for)
        booker.unexplained = 0.0
        self._prefill.sample(prompted, self._ledger.leases)
        self._mark_running(running, now)
        booker.finished = self._engine_finished(now, waiting, running)
        if used_tokens is not None and math.isfinite(used_tokens):
            booker.unexplained = self._correction(max(0.0, used_tokens), now, waiting)
        booker.booked = booker.book(now)[0]
        booker.changed()
        for told in self._engine_done.sample(booker.finished, now, self._pace.settle_after()):
            told()

    def on_engine_done(self, lease_id: str, callback: Callable[[], None]) -> None:
        """Call `callback` once, at a feed sample, when the engine is confirmed to have finished the lease
        while its client still reads (`engine_done`: found so in consecutive samples over `settle_after`);
        never after its release. Nothing for a lease not booked here."""
        if lease_id in self._ledger.leases:
            self._engine_done.watch(lease_id, callback)

    def forget(self, lease_id: str) -> None:
        """A lease released: nobody is told of it any more."""
        self._engine_done.forget(lease_id)

    def replica_share(self, now: float) -> ReplicaShare:
        """This replica's figures of the pool for the others (`kv_fleet.ReplicaShare`): what its leases are
        booked for, the KV they explain now, their settled sequences and those that may be finished; the
        store's next answer is read against what it sent (`PoolShare.sent`)."""
        held = 0.0
        settled = candidates = 0
        settled_before = now - self._pace.settle_after()
        rate, delay = self._pace.progress()
        for lease_id, lease in self._ledger.leases.items():
            if lease_id in self._booker.finished:
                continue
            held += lease.trajectory(now, rate, delay)[0]
            if lease.settled_by(settled_before):
                settled += lease.sequences
                if self._may_be_finished(lease, now):
                    candidates += lease.sequences
        booked = self._booker.own_booking(now)
        self._share.sent(booked)
        fleet = self._share.fleet
        yielding = fleet.publishing(now)
        frees = self._frees(now, booked)
        head = fleet.order.publishing()
        return ReplicaShare(
            booked, math.ceil(held), settled, candidates, yielding, fleet.heard_ms, frees, head_ms=head
        )

    def _frees(self, now: float, booked: int) -> tuple[int, ...]:
        """`ReplicaShare.frees`: what the leases' forecast ends free by each horizon, at the pace this
        replica's own hints plan on (`BudgetPace.releases`), never more than it has booked."""
        leases = self._ledger.leases
        running = (lease for i, lease in leases.items() if i not in self._booker.finished)
        return frees_by(self._pace.releases(running, now) or (), booked)

    def _correction(self, used: float, now: float, waiting: float | None) -> float:
        """`observe`'s correction of the forecasts from the KV in use (`used`, the pool's): upward by what no
        lease explains, downward by what the settled leases are booked for beyond the KV in use.

        With the other replicas' figures (`fleet`), their leases explain their part of `used`, and hold at
        least their floor of it. Without them, upward this replica takes its share of `used` as its own,
        as before; downward it compares its settled leases with the whole of `used`: the others may hold
        nothing, and a part of `used` taken for theirs would take off KV this replica's leases hold."""
        explained = settled = 0.0
        settled_before = now - self._pace.settle_after()
        rate, delay = self._pace.progress()
        for lease_id, lease in self._ledger.leases.items():
            if lease_id in self._booker.finished:
                continue
            explained += lease.trajectory(now, rate, delay)[0]
            if lease.settled_by(settled_before) and self._prefilled(lease_id):
                settled += lease.own_prompt + lease.streamed
        # Downward, the whole gauge: what the others' leases held is one exchange old, and taken off `used`
        # after they released it, left this replica's leases less room than they hold (an idle replica booked
        # -2,903 tokens).
        others = self._share.fleet.held_by_others(now)
        mine = used * self._share.budget_share() if others is None else used - others
        if mine > explained:
            return mine - explained
        if waiting == 0 and settled > used:
            return used - settled
        return 0.0

    def _prefilled(self, lease_id: str) -> bool:
        """Whether the engines' counts allow the lease to be wholly prefilled (`PrefillEvidence`); where they
        publish no prompt counter, admitted `settle_after` ago is all there is to go by."""
        prefill = self._prefill
        return prefill.prefilled(lease_id) if prefill.known else True

    def _may_be_finished(self, lease: Lease, now: float) -> bool:
        """Whether the engine may have finished `lease` unseen (`_engine_finished`'s candidates): a stream
        stalled `settle_after` or more, or an answer nobody sees that a sample counted running."""
        if lease.first_progress is None:
            return lease.engine_ran
        return now - (lease.last_progress_at or now) >= self._pace.settle_after()

    def _mark_running(self, running: float | None, now: float) -> None:
        """Marks the leases the engine may have started: this sample counts at least their sequences
        running (those that may be this replica's, `Fleet.running_mine`). A lease nobody sees progress on
        (lean) is found finished only once so marked (`_engine_finished`): before the engine counts it, a
        request can spend seconds in its API server or on the way there, and an engine that runs nothing
        then would have it found finished before it began (in CI's engine tier, vLLM counted a slow reader
        running seconds after the sidecar had given its slot back). Another lease's sequences can stand in
        for its own: a guard against an idle engine's count, not proof."""
        if running is None or not math.isfinite(running):
            return
        count = self._share.fleet.running_mine(max(0.0, running), now)
        for lease in self._ledger.leases.values():
            if not lease.engine_ran and count >= lease.sequences:
                lease.engine_ran = True

    def _engine_finished(self, now: float, waiting: float | None, running: float | None) -> frozenset[str]:
        """The leases the engine has finished, by count: with nothing waiting, every lease admitted more
        than `settle_after` ago runs there (its sequences are among `running`) unless the engine has
        finished it. Where the settled leases' sequences outnumber the engine's running ones, that many are
        done (`Fleet.finished_allowance`: of the whole pool's settled leases where the other replicas' are
        known, divided between the replicas by their candidates; else of this replica's against every
        running sequence, since any of them may be another replica's). They are taken first from streams
        whose progress stopped `settle_after` ago or more (a slow reader's answer reaches the sidecar at its
        client's pace, behind the proxy's full buffers), longest stalled first, then from those whose
        progress nobody sees and that a sample has counted running (`_mark_running`), furthest into their
        expected answer first, never more sequences than the excess. A wrong guess books too little only
        until the next sample: the KV in use that the remaining leases do not explain is added back to every
        forecast."""
        if waiting != 0 or running is None or not math.isfinite(running) or not self._booker.forecasting(now):
            return frozenset()
        settled_before = now - self._pace.settle_after()
        settled = {
            lease_id: lease
            for lease_id, lease in self._ledger.leases.items()
            if lease.settled_by(settled_before)
        }
        candidates = self._candidates(settled, now)
        excess = self._share.fleet.finished_allowance(
            sum(lease.sequences for lease in settled.values()),
            sum(lease.sequences for _, lease in candidates),
            max(0.0, running),
            now,
        )
        finished: list[str] = []
        for lease_id, lease in candidates:
            if lease.sequences > excess:
                break
            excess -= lease.sequences
            finished.append(lease_id)
        return frozenset(finished)

    def _candidates(self, settled: dict[str, Lease], now: float) -> list[tuple[str, Lease]]:
        """The settled leases the engine may have finished, in the order `_engine_finished` takes them."""
        rate, delay = self._pace.progress()

        def progress(item: tuple[str, Lease]) -> tuple[float, float]:
            lease = item[1]
            done = lease.generated(now, rate, delay)
            fraction = (done or 0.0) / max(1, lease.expected_completion)
            return (-fraction, lease.admitted_at or 0.0)

        def stalled_for(item: tuple[str, Lease]) -> float:
            return now - (item[1].last_progress_at or now)

        unseen = sorted(
            (item for item in settled.items() if item[1].first_progress is None and item[1].engine_ran),
            key=progress,
        )
        # A stream whose progress stopped for `settle_after` is read slower than it was generated (the inline
        # profile sees an answer only as the proxy passes it on, at its client's pace): longest stalled first.
        after = self._pace.settle_after()
        streams = (item for item in settled.items() if item[1].first_progress is not None)
        stalled = sorted(
            (item for item in streams if stalled_for(item) >= after), key=stalled_for, reverse=True
        )
        return [*stalled, *unseen]
