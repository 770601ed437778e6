"""Steps an engine ran after a request's count, charged to the requests that stopped (vLLM #54947).

A request whose answer was not seen whole is charged its share of the pool's generation counters up to a
reading `ENGINE_STOP_S` past its end (`tally.EngineTally.count`): the engine stops within a step of the
abort. An engine that misses the abort (vLLM issue #54947; the engine tier saw a 4,000-token answer decoded
whole over 12 s after its client left) or sees it seconds late (a saturated host) decodes on, up to the
answer's allowance. While any replica runs a request in the pool, the counts of the requests running share
those steps out among themselves (a run stopped within `SHOWN_AFTER_STOP_S` is taken for still running where
the running count has room); once none does, they are nobody's: a flood whose streams ran on past its end was
charged 0.75 of what the engine generated, with one replica as with two.

The pool's readings show them: sequences running beyond what every gateway replica holds (running, or in the
engine's queue) are *lingering* (`TallyPoint.lingering`). A request counted while the newest reading shows
more lingering than the least of the last `RECENT_S` before its stop (its *baseline*: traffic sent around the
gateway that runs throughout, not a run-on that started lately nor an abort seen late at one reading) may be
one of them, and its settlement waits here (`follow`), holding its reservation a while longer; at most
`WAITING_PER_SEQUENCE` requests per lingering sequence wait, the longest waiting settling first. An interval
between two readings is *unshared* where no replica ran a request inside it: their sequence-seconds, read
again at its end (the other replicas' figures heard since revise its start), grew by less than one step of one
sequence; no count takes its steps. In a *shared* one the counts take the steps
of the sequences they know (running, or stopped within `tally.SHOWN_AFTER_STOP_S`: `Reading.shown`), and those
of the ones beyond them, *unclaimed*, go to nobody: a run-on that outlasts that while other requests come and
go (in process, eight streams 1.5 s apart, every other one run on 20 s: 0.78-0.91 of what was generated,
0.98-1.00 with them). Of each, the tokens of the lingering (unshared) or unclaimed (shared) sequences above
the lowest baseline waiting, at the pace the counts take every sequence to run (`Reading.interval_since`), are
split between the replicas by their runs stopped lately and their requests waiting (`Reading.share`, from
`RunFigures.shown` and `left` through the store) and, this replica's part, between its waiting requests by
their sequences, none past its room (the allowance less its count); a request counted after such intervals
since its stop takes its part of what no request here took of them (`_catch_up`). A request stops waiting at
the first reading with no more lingering than its baseline (whatever ran on has stopped), its room used, or
`RUN_ON_WAIT_S` past its stop; then it is charged its count and what it took here. Nothing is taken while
the other replicas go unheard (the store slow or gone): they may be running anything. The requests wait, and
once they are heard again, an interval read meanwhile in which no replica ran (their figures say since when
each ran nothing: `tally.RunFigures.idle`) is split as any unshared one (`RunOns._hear`).

Which of the waiting requests ran on is not known, only how many sequences did: each takes its part of the
tokens, so a flood is charged what the engine generated while one request may pay a little of another's run-on
(never past its own allowance). The interval a request stopped in is its count's as far as the count takes the
sequences running at its end for its own (a reading within `tally.SHOWN_AFTER_STOP_S` of the stop); one read
later (a saturated engine answers its page in seconds) leaves the run-on's steps in it to the run-ons, as
those of the intervals after it (an inline gateway on the real-engine tier charged a 4,000-token run-on 0.90
of it while they went to nobody). Traffic sent to the engine around the gateway that starts while a request
waits is taken for a run-on too where nothing of the gateway's runs, up to the waiting requests' rooms, for
`RUN_ON_WAIT_S` at most: only requests that ended unseen just before pay it, and at most their allowance, what
their reservation already holds.

Pure: the tally calls `observe` at each reading and `close` when the feed stops.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, replace

log = logging.getLogger(__name__)

RUN_ON_WAIT_S = 60.0
"""The longest a counted request waits, past its stop, for the engine to stop running on (an answer decoded
to its allowance after its client left takes tens of seconds on a busy engine): past it, its settlement
takes what it was given so far, and the rest of a run-on goes uncharged."""

ROOM_EPSILON = 0.5
"""Less room than this (tokens) is none: the request's allowance is used."""

RAN_EPSILON_S = 0.02
"""Sequence-seconds in an interval below this are none: less than one decode step of one sequence. Another
replica's counter moves by milliseconds after the fact (a stop it heard late from Envoy, `ran_until`): the
interval after a flood's last stop, its run-ons' steps in it, was taken for shared, and no count took them
(a fleet of two charged 0.91-0.97 of what the engine generated end to end)."""

WAITING_PER_SEQUENCE = 4
"""At most this many requests wait here per sequence lingering above their baseline (and four at least): a
run-on needs rooms for its tokens, not every request counted while it lasts, and each one waiting holds its
reservation. Past it the one waiting longest settles with what it took."""

RECENT_S = 30.0
"""How far back the intervals with a run-on are kept for a request counted after them (`RunOns._catch_up`):
past the longest a count waits for its reading and the other replicas' answer
(`engine_run.PEERS_COUNT_WAIT_S`, 20 s) after `ENGINE_STOP_S`."""
MAX_RECENT = 3000
"""At most this many of them (ten readings a second over `RECENT_S`)."""


@dataclass(frozen=True, slots=True)
class Reading:
    """The pool at one reading as the run-on split needs it: tokens generated so far, sequences running; of
    them `lingering`, those no replica held running, and `live`, those every replica holds running
    (`math.inf` while the other replicas go unheard); `ran`, the sequence-seconds every replica's runs ran
    since the reading before, that reading read again (`tally.EngineTally._ran_since`; a request that came
    and went between two readings ran in their interval); `share`, this replica's part of a run-on then:
    its runs stopped lately and its requests waiting, against every replica's (`RunFigures.shown` and
    `left`: the replicas whose clients left are the ones whose runs ran on; each takes its part whether or
    not its requests were counted yet, so two never both take all)."""

    at: float
    generated: float
    running: float
    lingering: float
    live: float
    ran: float = 0.0
    share: float = 1.0
    shown: float = 0.0
    """Every replica's sequences running or stopped within `tally.SHOWN_AFTER_STOP_S`: what the counts take
    for known at this reading. The running ones beyond them are *unclaimed*: no count takes their steps."""

    def unshared_since(self, last: Reading) -> bool:
        """Whether no replica ran a request at any time since `last`: no count takes this interval's steps.
        Their sequence-seconds decide, not the runs held at either end: those are the other replicas' figures
        as last heard, and a run they had stopped just before (its end not yet published) made the interval
        after a flood's last stop shared, its run-ons' steps taken by no count."""
        return not math.isinf(last.live) and not math.isinf(self.live) and self.ran <= RAN_EPSILON_S

    @property
    def unclaimed(self) -> float:
        """Sequences running beyond every replica's shown ones: no count takes their steps."""
        return max(0.0, self.running - self.shown)

    def interval_since(self, last: Reading) -> _Interval | None:
        """The interval since `last` as the run-ons see it: unshared, its lingering sequences; shared, those
        running beyond what the counts take for known, at the pace the counts take every sequence to run
        (its steps over the sequence-seconds the replicas ran in it and those sequences'); None while the
        other replicas go unheard (they may be running anything)."""
        grown, span = self.generated - last.generated, self.at - last.at
        if self.unshared_since(last):
            running, lingering = (last.running + self.running) / 2, (last.lingering + self.lingering) / 2
            pace = grown / max(running, 1e-9)
            return _Interval(last.at, self.at, grown, pace, lingering, self.share, running=running)
        if math.isinf(last.live) or math.isinf(self.live) or span <= 0.0:
            return None
        unclaimed = (last.unclaimed + self.unclaimed) / 2
        known = max(0.0, self.ran) / span
        pace, running = grown / max(known + unclaimed, 1e-9), (last.running + self.running) / 2
        return _Interval(last.at, self.at, grown, pace, unclaimed, self.share, running=running)


@dataclass(frozen=True, slots=True)
class _Shared:
    """An interval taken for shared at its end (some replica's runs ran in it, as known then): kept a while
    (`RECENT_S`) in case those seconds go back (`RunOns.revise`): a stop told half a second late made the
    interval after a flood's last stop shared, its run-ons' steps taken by no count (a fleet of two charged
    0.89-0.94 of what the engine generated, end to end). `interval`: the one kept for its unclaimed
    sequences, if any."""

    start: Reading
    end: Reading
    interval: _Interval | None


@dataclass(slots=True)
class _Waiting:
    """One counted request that may still run in the engine."""

    sequences: int
    stop: float
    counted_to: float
    baseline: float
    room: float
    done: Callable[[float], None]
    taken: float = 0.0

    @property
    def left(self) -> float:
        return self.room - self.taken

    def take(self, tokens: float) -> float:
        """Up to `tokens` more, within its room: what it took."""
        given = max(0.0, min(self.left, tokens))
        self.taken += given
        return given


@dataclass(slots=True)
class _Interval:
    """The time between two readings as the run-ons see it (`Reading.interval_since`): its tokens, the
    tokens a sequence generated in it (`pace`), the sequences whose steps no count takes (`lingering`: the
    two readings' mean), this replica's `share` of a run-on (`Reading.share`), and what of it was given to
    waiting requests here so far."""

    start: float
    end: float
    grown: float
    pace: float
    lingering: float
    share: float
    given: float = 0.0
    running: float = 0.0  # the sequences running, the two readings' mean

    def run_on(self, floor: float, sequences: float) -> float:
        """The tokens of `sequences` of the lingering sequences above `floor`, within this replica's share of
        them less what it gave already, every running sequence taken at one pace (as
        `tally.EngineTally.count` takes them)."""
        excess = self.lingering - floor
        if self.grown <= 0.0 or excess <= 0.0:
            return 0.0
        mine = self.pace * excess * self.share - self.given
        return max(0.0, min(self.pace * min(sequences, excess), mine))


class RunOns:
    """One pool's counted requests waiting for the engine to stop running on (see the module docstring)."""

    def __init__(self) -> None:
        self._waiting: dict[Hashable, _Waiting] = {}
        self._last: Reading | None = None
        self._closed = False
        self._recent: deque[_Interval] = deque()  # the unshared intervals of the last `RECENT_S`
        self._shared: deque[_Shared] = deque()  # the shared ones, in case they were not (`revise`)
        self._unheard: deque[tuple[Reading, Reading]] = deque()  # intervals read while not heard (`_hear`)

    @property
    def last_at(self) -> float | None:
        """The time of the last reading, if any: where the next one's `Reading.ran` starts."""
        return None if self._last is None else self._last.at

    def stopped_by(self, at: float) -> float:
        """The sequences waiting here whose requests stopped by `at`: this replica's `RunFigures.left`."""
        return float(sum(w.sequences for w in self._waiting.values() if w.stop <= at))

    def follow(
        self,
        key: Hashable,
        stop: float,
        counted_to: float,
        sequences: int,
        room: float,
        baseline: float,
        done: Callable[[float], None],
    ) -> None:
        """The request `key`, stopped at `stop`, was counted, its count taking the sequences running at a
        reading before `counted_to` for its own where nothing else could be them (`tally._Window`);
        `done(tokens)` is called with what it ran on, at once where it has no `room` or waits already (0),
        or where the newest reading shows no more lingering sequences than `baseline` (nothing stopped still
        runs) and no interval read while the other replicas went unheard waits for them (`_hear`): then with
        its part of the intervals since its stop, which came before it was counted (`_catch_up`)."""
        last = self._last
        lingering = 0.0 if last is None else last.lingering
        if self._closed or room < ROOM_EPSILON or key in self._waiting:
            call_safely(done, 0.0)
            return
        waiting = _Waiting(max(1, sequences), stop, counted_to, baseline, room, done)
        self._catch_up(waiting)
        if lingering <= baseline and not self._unheard:
            self._settle(waiting)
            return
        self._waiting[key] = waiting
        lingering = max([lingering, *(end.lingering for _, end in self._unheard)])
        bound = WAITING_PER_SEQUENCE * max(1, math.ceil(lingering - baseline))
        while len(self._waiting) > bound:
            self._settle(self._waiting.pop(next(iter(self._waiting))))

    def _catch_up(self, waiting: _Waiting) -> None:
        """The intervals kept from its stop to its count's reading, and the one it stopped in where that ends
        at `counted_to` or later (its count took the sequences running then for another's: what it left of
        the interval is the run-on's, `Reading.interval_since`): of each, its sequences' part of this
        replica's share, of what no request here took."""
        for interval in self._recent:
            if interval.start >= waiting.stop or interval.end >= waiting.counted_to:
                interval.given += waiting.take(interval.run_on(waiting.baseline, waiting.sequences))

    def observe(self, reading: Reading, seconds_at: Callable[[float], float] | None = None) -> None:
        """A new reading of the pool: the interval since the last one kept and split where some sequences
        ran in it whose steps no count takes (`Reading.interval_since`), the intervals read while the other
        replicas went unheard split once they are heard again (`_hear`, `seconds_at` as `revise` takes
        it), the requests that stop waiting told."""
        last, self._last = self._last, reading
        interval = None if last is None else reading.interval_since(last)
        if interval is not None and interval.lingering > 0.0:
            self._recent.append(interval)
            if self._waiting:
                self._split(interval)
        if last is not None and interval is not None and not reading.unshared_since(last):
            kept = interval if interval.lingering > 0.0 else None
            self._shared.append(_Shared(last, reading, kept))
        if last is not None and interval is None and reading.generated > last.generated:
            self._unheard.append((last, reading))
        self._drop_old(reading.at)
        if seconds_at is not None and self._unheard and not math.isinf(reading.live):
            self._hear(seconds_at, reading.share)
        for key, waiting in list(self._waiting.items()):
            if (
                waiting.left < ROOM_EPSILON
                or (reading.lingering <= waiting.baseline and not self._unheard)
                or reading.at - waiting.stop >= RUN_ON_WAIT_S
            ):
                self._settle(self._waiting.pop(key))

    def _drop_old(self, now: float) -> None:
        """The intervals kept past `RECENT_S` (or `MAX_RECENT` of a kind) go."""
        recent, shared, unheard = self._recent, self._shared, self._unheard
        while recent and (len(recent) > MAX_RECENT or now - recent[0].start > RECENT_S):
            recent.popleft()
        while shared and (len(shared) > MAX_RECENT or now - shared[0].start.at > RECENT_S):
            shared.popleft()
        while unheard and (len(unheard) > MAX_RECENT or now - unheard[0][0].at > RECENT_S):
            unheard.popleft()

    def _hear(self, seconds_at: Callable[[float], float], share: float) -> None:
        """The other replicas are heard again: each interval read while they were not is read again with
        `seconds_at` (every replica's sequence-seconds by a time, as known now: their figures say since when
        they ran nothing, `tally.RunFigures.idle`), and one in which no replica ran is a run-on's whole,
        split by this replica's `share` now (its part in the gap is not known: the others' runs stopped
        then and requests waiting were not heard; now each replica reads the others' at once, and the
        requests counted in the gap wait for it). One in which some replica ran is left: which of its
        sequences the counts took is not known. Left unread, the steps an engine ran on while the store's
        exchange stalled at a flood's end went to no count (a fleet flood on the real-engine tier charged
        0.669 of what vLLM generated)."""
        unheard, self._unheard = self._unheard, deque()
        for start, end in unheard:
            if seconds_at(end.at) - seconds_at(start.at) > RAN_EPSILON_S:
                continue
            self._unshare(_nobodys(start, end, share), None)

    def rethink(
        self, since: float, seconds_at: Callable[[float], float], shown_at: Callable[[float], float]
    ) -> None:
        """The other replicas answered after a gap from `since`: the intervals kept that end past it were
        read with their figures from before it, and a run they began since was taken for nobody's (in
        process, a 3.5 s stall of the store's exchange over a flood: charged 1.16-1.41 of what the engine
        generated). Each is read again with `seconds_at` and `shown_at` (every replica's sequence-seconds
        by a time, and sequences it may have held running then, as known now): where some replica ran in
        it, its sequences beyond those shown are what no count takes, if fewer than it held. Only fewer:
        what the others' answer cannot show (runs begun and stopped in the gap) is not made a run-on."""
        for interval in self._recent:
            if interval.end <= since:
                continue
            ran = seconds_at(interval.end) - seconds_at(interval.start)
            if ran <= RAN_EPSILON_S:
                continue  # no replica ran in it: its lingering sequences were nobody's
            shown = (shown_at(interval.start) + shown_at(interval.end)) / 2
            unclaimed = max(0.0, interval.running - shown)
            if unclaimed < interval.lingering:
                interval.lingering = unclaimed
                interval.pace = interval.grown / max(ran / (interval.end - interval.start) + unclaimed, 1e-9)

    def revise(self, since: float, seconds_at: Callable[[float], float], share: float) -> None:
        """The replicas' sequence-seconds changed after the fact from `since` on (another replica's figures
        went back: a stop it was told late, `tally.PeerRuns._revise`; or came after a gap in the answers,
        `tally.PeerRuns._bend`): each shared interval kept that ends past it is read again with `seconds_at`
        (every replica's seconds by a time, as known now), and one in which no replica ran after all is a
        run-on's whole (`_Shared`), split by this replica's `share` now (as `_hear` splits, and for its
        reason: read in a gap, the others' part was their figures before it). This sidecar's own runs are
        exact at each reading's time already (`tally.EngineTally.figures` looks back); revised here too, a
        single inline gateway was charged 1,202 of the 948 tokens generated once."""
        seconds: dict[float, float] = {}
        still: deque[_Shared] = deque()
        for shared in self._shared:
            if shared.end.at > since:
                for at in (shared.start.at, shared.end.at):
                    if at not in seconds:
                        seconds[at] = seconds_at(at)
                ran = seconds[shared.end.at] - seconds[shared.start.at]
                end = replace(shared.end, ran=ran, share=share)
                if end.unshared_since(shared.start):  # what ran in it was no replica's
                    self._unshare(_nobodys(shared.start, end, share), shared.interval)
                    continue
            still.append(shared)
        self._shared = still

    def _unshare(self, interval: _Interval, instead: _Interval | None) -> None:
        """An interval found unshared after the fact: kept and split as one (`observe`)."""
        if interval.lingering <= 0.0:
            return
        self._keep(interval, instead)
        if self._waiting:
            self._split(interval)

    def _keep(self, interval: _Interval, instead: _Interval | None) -> None:
        """`interval` among the recent ones, in its place by its start: `instead` of the one kept for that
        time, whose gifts it carries."""
        recent = self._recent
        for i, kept in enumerate(recent):
            if kept is instead:
                interval.given = kept.given
                del recent[i]
                break
        i = len(recent)
        while i > 0 and recent[i - 1].start > interval.start:
            i -= 1
        recent.insert(i, interval)

    @staticmethod
    def _settle(waiting: _Waiting) -> None:
        """It waits no more: told what it took."""
        call_safely(waiting.done, waiting.taken)

    def _split(self, interval: _Interval) -> None:
        """This replica's share of the interval's run-on (above the lowest baseline waiting), between its
        waiting requests (`_hand_out`)."""
        floor = min(w.baseline for w in self._waiting.values())
        interval.given += self._hand_out(interval.run_on(floor, math.inf))

    def spill(self, tokens: float) -> None:
        """A count took `tokens` past its request's allowance: steps of sequences it took for its own that
        were not (the engine generates no more than the allowance), run-ons shown as stopped or past every
        count. They go to the requests waiting here (`_hand_out`), not to nobody: the last stream of a
        flood, counted while the run-ons of three others decoded on, took 381 tokens of its 150 in
        process, and the flood was charged 0.81 of what the engine generated."""
        if tokens > 0.0:
            self._hand_out(tokens)

    def _hand_out(self, tokens: float) -> float:
        """`tokens` between the waiting requests by their sequences, none past its room; what one cannot
        take goes to the others. What they took."""
        open_ = [w for w in self._waiting.values() if w.left >= ROOM_EPSILON]
        handed = 0.0
        while tokens - handed > 1e-9 and open_:
            each = (tokens - handed) / sum(w.sequences for w in open_)
            for waiting in open_:
                handed += waiting.take(each * waiting.sequences)
            open_ = [w for w in open_ if w.left >= ROOM_EPSILON]
        return handed

    def give_up(self, key: Hashable) -> float:
        """The request `key` waits no more (no reading came for long): what it has taken, without `done`."""
        waiting = self._waiting.pop(key, None)
        return 0.0 if waiting is None else waiting.taken

    def close(self) -> None:
        """The feed stopped: every request waiting is charged what it has taken, and any later one at once
        nothing."""
        self._closed = True
        waiting, self._waiting = self._waiting, {}
        for item in waiting.values():
            self._settle(item)


def _nobodys(start: Reading, end: Reading, share: float) -> _Interval:
    """The interval between two readings found after the fact to be one in which no replica ran
    (`RunOns.revise`, `RunOns._hear`): every sequence running in it lingered, split by this replica's
    `share`."""
    running, grown = (start.running + end.running) / 2, end.generated - start.generated
    pace = grown / max(running, 1e-9)
    return _Interval(start.at, end.at, grown, pace, running, share, running=running)


def call_safely(done: Callable[[float], None], tokens: float) -> None:
    """`done(tokens)`; an exception in it is logged, never raised into the feed's loop."""
    try:
        done(tokens)
    except Exception:
        log.exception("run-on waiter failed")
