"""What a pool's engines generated for one request whose answer was not seen whole, from their counters.

A non-streamed answer whose client left, or a request whose end report never came, passed no token through
the proxy, and a stream left mid-answer passed fewer than the engine generated before the abort reached it:
the sidecar must estimate what the engine generated for it. A pace times its time errs by the
pace: one learned from single answers is not what each of `n` sequences decoded together runs at (on the
real-engine tier an n=4 answer left after 1.5 s was charged 1.10 to 1.29 times what vLLM counted, 2.1 to 3.3
on another host). The engines count it themselves: the feed carries each endpoint's generation-token counter
(vLLM's `vllm:generation_tokens_total`) with its running requests, and `EngineTally` keeps, per pool, the
sum of the counters' growth and of the running sequences at each sample (`TallyPoint`).

`count(start, stop, sequences, tail, key)` is a request's share of that growth over its time: in each
interval between two points, the tokens generated split in proportion to the sequence-seconds each request
ran. Ours is `sequences` over the part of the interval inside [start, stop]. The others this sidecar
admitted into the pool ran as it saw them: each request's run (`begin` at its admission, `end` when the
engine is done with it) is kept, so a closed loop of clients (one request leaving as the next comes) or a
burst that starts and ends together splits exactly. The rest (another replica's requests, runs forgotten)
are the running count at the interval's ends less ours where we ran then and the known ones running then,
averaged over the interval: exact for requests running throughout, half of it for one that came or went
inside. A known run is taken for running at a point up to `SHOWN_AFTER_STOP_S` past its stop (the engine
runs an aborted request on until the abort reaches it, and the running count shows it): taken for another
replica's, the steps an engine ran a flood's streams on after their clients left went to nobody. Alone on
the pool, or beside only known runs, the shares sum to the growth whatever the scrape interval; past
`stop`, an interval that starts before `stop + tail` with our sequences still running beside the known ones
and ends with the engine idle counts as ours too (the step the abort found, read after the end). A
request queued in the engine counts as running (the feed's running count does not show it), as does the
time between its admission and its first step: beside unknown others it errs high, as the pace estimate
does. An unknown one that started and ended between two points is invisible to their running counts: its
tokens count as those the points show running. The split takes every running sequence to decode at one
pace (nearly so on a GPU; on a CPU engine a sequence among eight runs at a fraction of one alone).

A count needs a point at or before `start` and one at or after `stop + tail`: the caller waits for the latter
(`after(t, callback)`, called at the first point at or after `t`) and, beside other replicas, for their answer
at or after `t` (`covers`). Points are at the sidecar's clock when
the exporter read the page, not when its sample arrived (`kvfeed/subscriber/readtime.py`). Memory
is bounded (`series.Series`, as for the other replicas' runs below): at most `max_points` per pool, one per
`min_spacing_s` (a newer one replaces a last one that came sooner), 20,000 at 0.1 s, over half an hour at ten
samples a second: a request older than the points kept gets no count (None), and the caller charges its pace
estimate. An endpoint whose counter goes back (a restart) starts a new baseline; one gone from the feed
(`forget`) leaves the sum as it was; a failed scrape changes nothing (the next reading's growth counts).
Runs: every request in flight here, and the last `MAX_ENDED_RUNS` ended (20,000: older ones count among the
unknown), none begun over `MAX_RUN_S` (two hours) before the newest.

Beside other gateway replicas, each with a tally of its own, the pool's running count holds their requests
too: taken for unknown ones they are only the running count's room, which this sidecar's runs stopped in the
last `SHOWN_AFTER_STOP_S` fill in a flood, and every replica then takes the whole growth for its own (two
gateways charged a flood 2.00 times what vLLM counted). So each replica publishes its runs' figures through
the shared store (`figures`: the sequence-seconds its runs ran, a counter, and its sequences running and
shown), and `observe_peers` keeps the others' over time (`PeerRuns`): in each interval their sequence-seconds
count beside the known runs and their shown sequences among those the running count holds, so the
replicas' shares of an interval sum to its growth, the steps an engine ran after a client left included
while its run is shown. An answer the engine decodes on past that (it missed the abort: vLLM #54947) came
after its count; those steps are charged to the requests that stopped, up to their allowances
(`runon.RunOns`, `follow_run_on`): in process, two of 24 streams run on 12 s after their clients left
brought a flood to 0.75 of what was generated by the counts alone, 1.00 with them
(tests/unit/core/engine/test_runon.py). A stall of the store's exchange leaves a gap in the others' answers:
each says how long it has run nothing (`RunFigures.idle`), and what it ran in the gap is put before that
(`PeerRuns._bend`).

A share is noisy (a fifth either way for one request of a flood) while the tokens that passed a stream are
certain: `charge` lifts a share to them and takes what it lifted off the next shares above theirs, so the
charges still sum to the count.

Pure: no clock, no I/O; the feed's loop calls `observe` on its event loop, admission reads `count`.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import logging
import math
from collections import deque
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, replace

from extproc.core.engine.counter import PoolCounter
from extproc.core.engine.runon import RECENT_S, Reading, RunOns
from extproc.core.engine.series import Series

log = logging.getLogger(__name__)

MAX_POINTS = 20_000
MIN_SPACING_S = 0.1
PEER_SPACING_S = 0.04
"""The closest two readings of the other replicas' runs are kept (`PeerRuns`): under the store's publication
interval (`kv_fleet.PUBLISH_EVERY_S`, 50 ms), so each answer is kept. Kept one per `MIN_SPACING_S`, a run
that began and ended between two kept answers was spread over their span, and the run-ons, reading the
other replicas' sequence-seconds at their last reading again, took their steps for shared: in process,
two replicas' floods of short streams within 5 % of what the engine generated in 33-36 of 40 seeds, 40 of
40 with each answer kept. 20,000 of them: over 15 minutes at that pace, and a count reaching further back
takes the other replicas' runs of that time for unknown (as the running count shows them)."""
MAX_ENDED_RUNS = 20_000
MAX_RUN_S = 7200.0  # past any request's lifetime bound (`admission.max_request_seconds`, 1,800 s by default)
SHOWN_AFTER_STOP_S = 5.0
"""How long after its stop a run this sidecar saw end is taken for still running where a reading's running
count has room for it (`_known`): an engine runs an aborted request on until the abort reaches it, up to
two seconds and more on a saturated host (vLLM's API server notices a client gone late); taken for another
replica's, the tokens it generated then are charged to nobody. Beside another replica's requests, a run
taken for running that the engine had stopped hides one of theirs: the requests counted then are charged a
little of its tokens."""
RETHINK_GAP_S = 1.0
"""The other replicas' answers this far apart are a gap (the store's exchange stalled, or an idle pool
published at its feed's samples only): the run-on intervals read in it are read again once they answer
(`runon.RunOns.rethink`). Closer answers (a pool in use publishes every `kv_fleet.PUBLISH_EVERY_S`) leave the
readings as they were."""
IDLE_SEEN_S = 2 * SHOWN_AFTER_STOP_S
"""How far back a replica looks for its last stop (`RunFigures.idle`): the stops it keeps for its shown runs
(`EngineTally.figures` scans them back that far); a replica idle longer says this."""
PEER_STALE_S = 3.0
"""How long past the last reading of the other replicas' runs their figures are carried forward (their
sequence-seconds growing at the sequences they then ran): the store publishes them every
`kv_fleet.PUBLISH_EVERY_S` while a pool changes and at each feed sample, and a budget trusts the last answer
as long (`kv_fleet.PEERS_FRESH_S`); past it, a store gone says nothing of them."""
TOLD_LATE_S = 10.0
"""The longest after a stop a replica is told it (`EngineTally.end`; the lean profile's end report comes
through Envoy's access log): a replica's counter that goes back by at most its running sequences times this
counted them past their stops (`PeerRuns._revise`); by more, its tally began again (the feed restarted on a
reload: the same name, a new counter), a new baseline."""
MISSING_S = 10.0
"""How long a replica missing from the store's answers keeps the counts waiting (`PeerRuns.known_by`): past
`kv_fleet.REPLICA_TTL_S`, after which a stalled replica's figures expire from the store. Taken for one running
nothing, a sidecar held up 5.3 s on the real-engine tier counted a 70 ms stream 407 tokens. A replica gone for
good holds them this long, then not."""
PEER_GAP_S = 60.0
"""How long a replica missing from the store's answers is remembered (`PeerRuns.observe`): its figures
expire there `kv_fleet.REPLICA_TTL_S` after its last publication, so a store or a replica stalled that long,
or a host frozen for seconds, drops it from the answers while its requests run on. Its counter is its own
since it started (a replica that restarts has a new name), so the growth it shows on its return is what it
ran meanwhile: taken for a new baseline, that was lost, and the other replica's counts took those steps (a
fleet flood on the real-engine tier, both sidecars frozen 9 s while three streams ran on, charged 1.43 times
what vLLM counted; replayed from its logs with the gap spread, 1.26). Past this, a new baseline."""
ENGINE_STOP_S = 1.5
"""How long after a request ended on the proxy its engine may still run it, and its counter grow for it: the
client's reset must reach vLLM's API server, its abort the engine core between two steps
(`decode_rate.STEPS_PAST_ABORT`), and the server counts a step's tokens as it hands the step's outputs on
(vllm 0.32.0 vllm/v1/engine/async_llm.py, `output_handler`, which records each batch of outputs into
`vllm:generation_tokens_total`): tens of milliseconds on a GPU; on the real-engine tier's two busy cores up to
a second (a flood of streams left after three chunks, 13 tokens generated a stream where four passed). A
count (`tracking.engine_run`) waits for a reading this long after the end; its own steps read after the end
with the engine idle then count as its own (`EngineTally.count`'s `tail`), and the runs ended before it are
taken for still running for longer where the feed's running count has room (`SHOWN_AFTER_STOP_S`). Steps
read past it are a run-on (`runon.py`)."""
MAX_LIFTED = 100_000.0
"""The most tokens of shares lifted to their floors the pool holds to be paid back (`EngineTally.charge`):
past a flood's worth, so a split that errs low for long (beside another replica's requests) cannot take
more than that off later shares."""


def shown_after(tail: float) -> float:
    """How long past its stop a count takes its request's sequences for still running where the running
    count grew by them (`_Window.shown_end`), its `tail` included: the run-ons take what it left of the
    interval its request stopped in where the reading that ends it comes later (`runon.RunOns._catch_up`)."""
    return max(tail, SHOWN_AFTER_STOP_S)


def no_tally(pool: str) -> EngineTally | None:
    """No feed: no pool has a tally (what admission asks before the feed is wired)."""
    return None


@dataclass(frozen=True, slots=True)
class TallyPoint:
    """The pool at one reading (its time kept by the `Series`): `generated` tokens since the tally began,
    `running` sequences then, of which `lingering` no replica held running (stopped by the proxy but not
    yet by the engine, or sent around the gateway: `runon.py`)."""

    generated: float
    running: float
    lingering: float = 0.0


@dataclass(frozen=True, slots=True)
class RunFigures:
    """One replica's runs of a pool as the other replicas' tallies need them: `seconds`, the sequence-seconds
    they ran since its tally began (a counter: only its growth between two readings means anything);
    `running`, the sequences running now; `shown`, those and the ones stopped within `SHOWN_AFTER_STOP_S`
    (what a reading's running count may still hold of them); `left`, the sequences of its counted requests
    waiting for a run-on (`runon.RunOns`) that stopped before those: each request weighs once in a
    replica's part of a run-on (`Reading.share`). Counted twice, a replica's part jumped as it counted its
    requests, and the others, which had read its figures just before, took theirs as if they were not
    there: two gateways charged a flood 1.003-1.023 of what the engine generated, end to end."""

    seconds: float = 0.0
    running: float = 0.0
    shown: float = 0.0
    left: float = 0.0
    idle: float = 0.0
    """How long none of its runs has run (0 while one does), `IDLE_SEEN_S` at most: where the other
    replicas' answers came after a gap, their seconds grew before it (`PeerRuns._bend`)."""


class PeerRuns:
    """The other replicas' runs of one pool over time, read from the store: their figures summed at each
    reading, the sequence-seconds as a counter (each replica's own a baseline of its first reading, one gone
    and back a new one, as an endpoint's generation counter is). Bounded as the tally's points are
    (`series.Series`)."""

    def __init__(self, max_points: int = MAX_POINTS, min_spacing_s: float = MIN_SPACING_S) -> None:
        self._last: dict[str, tuple[float, float, float]] = {}  # replica -> seconds, when, running
        self._heard: float | None = None  # when the store last answered
        self._seconds = 0.0
        self._readings: Series[RunFigures] = Series(max_points, min_spacing_s)
        self._spacing = min_spacing_s
        self.revised_from = math.inf  # the earliest reading `_revise` lowered, until the tally reads it

    def observe(self, replicas: Mapping[str, RunFigures], at: float) -> float | None:
        """The figures of every other live replica, read at `at`. One missing from them is gone, or its
        figures expired in the store (it, or the store, stalled past `kv_fleet.REPLICA_TTL_S`): back within
        `PEER_GAP_S`, the sequence-seconds it ran meanwhile are spread over the readings it missed. A
        replica's growth since its last answer ends where it says it went idle (`RunFigures.idle`): after a
        gap in the answers (the store's exchange stalled), the readings in it are bent there (`_bend`). The
        answer before this one where it came over `RETHINK_GAP_S` before: a gap; else None."""
        answered, self._heard = self._heard, at
        last = self._readings.last_at()
        growths: list[_Growth] = []
        for name, figures in replicas.items():
            before = self._last.get(name)
            if before is None:
                continue
            grown = figures.seconds - before[0]
            if grown < 0.0:  # a stop told late (it had counted the run as running past it), or a new tally
                self._seconds += grown if -grown <= before[2] * TOLD_LATE_S else 0.0
                continue
            growth = _Growth(before[1], max(before[1], min(at, at - figures.idle)), grown)
            if last is not None and before[1] < last:
                self._spread(growth)
            growths.append(growth)
        remembered = {name: seen for name, seen in self._last.items() if at - seen[1] <= PEER_GAP_S}
        self._last = remembered | {name: (f.seconds, at, f.running) for name, f in replicas.items()}
        values = replicas.values()
        now = RunFigures(
            0.0,
            sum(f.running for f in values),
            sum(f.shown for f in values),
            sum(f.left for f in values),
        )
        if last is not None:
            self._bend(growths, last, at, now)
        self._seconds += sum(g.grown for g in growths)
        went_back = bool(self._readings.items) and self._seconds < self._readings.items[-1].seconds
        self._readings.add(at, replace(now, seconds=self._seconds))
        if went_back:
            self._revise()
        return answered if answered is not None and at - answered > RETHINK_GAP_S else None

    def _bend(self, growths: list[_Growth], last: float, at: float, now: RunFigures) -> None:
        """Readings between the last one and `at` where a replica's growth ended (it went idle then), so
        that the seconds it ran before a gap in the answers are not spread past its idling: the interval
        after a flood's last stop, read while the store's exchange stalled, was taken for shared."""
        bends = sorted({g.until for g in growths if last + self._spacing <= g.until <= at - self._spacing})
        for bend in bends:
            grown = sum(g.by(bend) for g in growths)
            self._readings.add(bend, replace(now, seconds=self._seconds + grown))
        if bends:  # the intervals read since `last` took their seconds as growing on: read them again
            self.revised_from = min(self.revised_from, last)

    def _revise(self) -> None:
        """The readings before the last one no higher than it: the sum of counters that only grow. A
        replica's counter goes back by a little (`TOLD_LATE_S`) only where it had counted a run as running
        past a stop it was told later (Envoy's end report, the lean profile's access log): the readings since
        that stop held those seconds. Kept, they made the intervals after a flood's last stop look shared,
        and their run-ons' steps went to no count: two gateways charged a flood 0.91-0.97 of what the
        engine generated, end to end."""
        times, items = self._readings.times, self._readings.items
        for i in range(len(items) - 2, -1, -1):
            if items[i].seconds <= items[i + 1].seconds:
                return
            items[i] = replace(items[i], seconds=items[i + 1].seconds)
            self.revised_from = min(self.revised_from, times[i])

    def _spread(self, growth: _Growth) -> None:
        """The growth of a replica missing from the readings since its last answer, added to each of them
        (`_Growth.by`)."""
        readings = self._readings
        times, items = readings.times, readings.items
        for i in range(readings.at_or_before(growth.since) + 1, len(times)):
            items[i] = replace(items[i], seconds=items[i].seconds + growth.by(times[i]))

    def seconds_at(self, at: float) -> float:
        """Their sequence-seconds by `at`: between two readings, along the line between them; before the
        first, its value; past the last, grown at the sequences then running, for `PEER_STALE_S` at most."""
        readings = self._readings
        times, items = readings.times, readings.items
        if not times:
            return 0.0
        i = readings.at_or_before(at) + 1
        if i == 0:
            return items[0].seconds
        t0, s0 = times[i - 1], items[i - 1].seconds
        if i == len(times):
            return s0 + items[i - 1].running * min(at - t0, PEER_STALE_S)
        t1, s1 = times[i], items[i].seconds
        return s0 + (s1 - s0) * (at - t0) / (t1 - t0) if t1 > t0 else s1

    def shown_around(self, at: float) -> float:
        """Their sequences that may have run at `at` as the readings on both sides of it show them, the more
        of the two (`EngineTally._shown_at`): a run begun and stopped between two answers is in neither."""
        readings = self._readings
        i = readings.at_or_before(at)
        around = readings.items[max(0, i) : i + 2]
        return max((f.shown for f in around), default=0.0)

    def shown_at(self, at: float) -> float:
        """Their sequences that may be running at `at`: those the last reading at or before it showed, none
        where that reading is over `PEER_STALE_S` older (or none is)."""
        return self.fresh_at(at).shown

    def fresh_at(self, at: float) -> RunFigures:
        """Their figures as the last reading at or before `at` gave them; none (zeros) where that reading is
        over `PEER_STALE_S` older (or none is)."""
        readings = self._readings
        i = readings.at_or_before(at)
        if i < 0 or at - readings.times[i] > PEER_STALE_S:
            return RunFigures()
        return readings.items[i]

    def heard_after(self, at: float) -> bool:
        """Whether they answered after `at` (or never do: no store)."""
        return self._heard is None or self._heard > at

    def known_by(self, at: float) -> bool:
        """Whether their runs up to `at` are known: an answer came at or after it with every replica seen in
        the last `MISSING_S` (one missing is not known to have run nothing: its figures expired from the
        store while it or the store stalled), or none of them is left to tell (no store, no other replica
        lately). Carried forward from an earlier answer, the sequences it showed stopped lately fill the
        running count while their seconds stay flat, and the runs they began since are nobody's."""
        heard = self._heard
        if heard is None or not self._last:
            return True
        missing = any(heard - MISSING_S < seen < heard for _, seen, _ in self._last.values())
        return heard >= at and not missing

    def seen_at(self, at: float) -> bool:
        """Whether their runs at `at` are known: never exchanged (no store: no other replica), or the last
        exchange at most `PEER_STALE_S` before `at` (a store slow or gone says nothing of them, nor whether
        one has come)."""
        return self._heard is None or at - self._heard <= PEER_STALE_S


@dataclass(slots=True)
class Lifts:
    """A pool's shares lifted to their floors and not yet paid back by later shares (`charge`)."""

    owed: float = 0.0

    def charge(self, counted: float, floor: float) -> float:
        """A request's counted share as its charge, at least `floor` (the tokens that passed: the engines
        generated them for certain). A share under its floor took what the split gave its neighbours, so it
        is lifted and the pool owes the difference; the next shares over their floors pay it back, never
        below their own floors, and a flood's charges still sum to the engines' count (at most
        `MAX_LIFTED` owed)."""
        if counted < floor:
            self.owed = min(MAX_LIFTED, self.owed + floor - counted)
            return floor
        repaid = min(self.owed, counted - floor)
        self.owed -= repaid
        return counted - repaid


@dataclass(frozen=True, slots=True)
class _Growth:
    """One replica's sequence-seconds `grown` since its answer at `since`, all of them run by `until` (when
    it went idle, or the answer that shows them)."""

    since: float
    until: float
    grown: float

    def by(self, at: float) -> float:
        """What of it had run by `at`: along the line from `since` (nothing) to `until` (all of it)."""
        if at >= self.until:
            return self.grown
        return self.grown * max(0.0, at - self.since) / (self.until - self.since)


@dataclass(slots=True)
class _Run:
    """One request this sidecar admitted into the pool: `sequences` running from `start` until `stop`."""

    start: float
    sequences: int
    stop: float | None = None

    @property
    def until(self) -> float:
        """Its stop, or never while it runs."""
        return self.stop if self.stop is not None else math.inf

    def overlap(self, lo: float, hi: float) -> float:
        return max(0.0, min(hi, self.until) - max(lo, self.start))


class EngineTally:
    """One pool's generation counters over time (see the module docstring)."""

    def __init__(self, max_points: int = MAX_POINTS, min_spacing_s: float = MIN_SPACING_S) -> None:
        self._points: Series[TallyPoint] = Series(max_points, min_spacing_s)
        self._generated = PoolCounter()  # the endpoints' generation counters, summed as growth
        self._engine_running: dict[str, float] = {}  # endpoint -> its running requests last read
        self._engine_waiting: dict[str, float] = {}  # endpoint -> its queued requests last read
        self._waiters: list[tuple[float, int, Callable[[], None]]] = []
        self._order = itertools.count()
        self._closed = False  # the feed stopped: waiters are called at once
        self._lifts = Lifts()
        self._counted_at = -math.inf  # the last answer after a gap that let counts be had (`observe`)
        self._runs: dict[Hashable, _Run] = {}  # this sidecar's requests in the pool, by lease
        self._ended: deque[Hashable] = deque()  # the ended ones, oldest first, at most `MAX_ENDED_RUNS`
        # The other replicas' runs (`observe_peers`), each answer kept.
        self.peers = PeerRuns(max_points, min(min_spacing_s, PEER_SPACING_S))
        self.run_ons = RunOns()  # counted requests the engine may run on (`follow_run_on`)
        # This sidecar's runs summed for `figures`: the sequence-seconds of the ended ones, and the running
        # ones' sequences and sequences times start (their seconds by `now`: sequences x now less that).
        self._ended_seconds = 0.0
        self._running = 0
        self._running_starts = 0.0

    def begin(self, key: Hashable, start: float, sequences: int) -> None:
        """This sidecar admitted a request of `sequences` into the pool at `start` (`key`: its lease). Runs
        begun over `MAX_RUN_S` before go, ended or not: no request lives that long, and one never ended
        (a bug elsewhere) must not count as running forever."""
        stale = []
        for old_key, run in self._runs.items():
            if run.start >= start - MAX_RUN_S:
                break
            stale.append(old_key)
        for old_key in stale:
            self._not_running(self._runs.pop(old_key))
        self._not_running(self._runs.pop(key, None))
        run = self._runs[key] = _Run(start, max(1, sequences))
        self._running += run.sequences
        self._running_starts += run.sequences * start

    def _not_running(self, run: _Run | None) -> None:
        """A run forgotten: if it was running, out of the running sums (its seconds go uncounted)."""
        if run is not None and run.stop is None:
            self._running -= run.sequences
            self._running_starts -= run.sequences * run.start

    def end(self, key: Hashable, stop: float) -> None:
        """The request `key` ended at `stop` (the engine is done with it); once."""
        run = self._runs.get(key)
        if run is None or run.stop is not None:
            return
        run.stop = max(stop, run.start)
        self._running -= run.sequences
        self._running_starts -= run.sequences * run.start
        self._ended_seconds += run.sequences * (run.stop - run.start)
        self._ended.append(key)
        while len(self._ended) > MAX_ENDED_RUNS:
            self._runs.pop(self._ended.popleft(), None)

    def ran_until(self, key: Hashable, stop: float) -> None:
        """The request `key` ran until `stop`, later than the end it was told (Envoy read its upstream on
        after the client left): its stop moves there; an earlier `stop` changes nothing."""
        run = self._runs.get(key)
        if run is None:
            return
        if run.stop is None:
            self.end(key, stop)
        elif stop > run.stop:
            self._ended_seconds += run.sequences * (stop - run.stop)
            run.stop = stop

    def stop_of(self, key: Hashable) -> float | None:
        """The stop of the request `key` as told (`end`, `ran_until`); None while it runs, or forgotten."""
        run = self._runs.get(key)
        return None if run is None else run.stop

    def figures(self, at: float) -> RunFigures:
        """This sidecar's runs as the other replicas' tallies need them (`RunFigures`) at `at`: now where it
        publishes them through the shared store; a reading's time in `observe`, seconds back where its sample
        came late (`kvfeed/subscriber/readtime.py`), so the runs begun or ended since are taken back."""
        seconds, running = self._seconds(at), float(self._running)
        for begun in reversed(self._runs.values()):  # begun in order
            if begun.start <= at:
                break
            if begun.stop is None:  # begun since and running: `_seconds` gave it (at - start), below zero
                seconds += begun.sequences * (begun.start - at)
                running -= begun.sequences
        shown, since, latest = 0.0, at - SHOWN_AFTER_STOP_S, at - IDLE_SEEN_S
        for key in reversed(self._ended):  # ended in order; a stop moved later by `ran_until` is rare
            run = self._runs.get(key)
            if run is None or run.until <= at - IDLE_SEEN_S:
                break
            if run.until > at:  # ended since: what it ran after `at` is taken back; it ran then
                seconds -= run.sequences * (run.until - max(at, run.start))
                running += run.sequences if run.start < at else 0
            else:
                shown += run.sequences if run.until > since else 0
                latest = max(latest, run.until)
        left = self.run_ons.stopped_by(since)  # the others are shown already
        idle = at - latest if running == 0 else 0.0
        return RunFigures(max(0.0, seconds), running, running + shown, left, idle)

    def _seconds(self, now: float) -> float:
        """The sequence-seconds this sidecar's runs ran by `now` (a counter)."""
        return self._ended_seconds + self._running * now - self._running_starts

    def observe_peers(self, replicas: Mapping[str, RunFigures], at: float) -> None:
        """The other live replicas' figures of the pool, read from the store at `at` (`PeerRuns`); after a gap
        in their answers, the run-ons read in it again (`RunOns.rethink`), the counts waiting called."""
        unheard = not self.peers.seen_at(at)
        gap = self.peers.observe(replicas, at)
        if gap is not None:
            self.run_ons.rethink(gap, self._seconds_at, self._shown_at)
        last = self._points.last_at()
        if last is not None and self._wake(last) and unheard:
            self._counted_at = at

    def observe(self, endpoint: str, counter: float, running: float, at: float, waiting: float = 0.0) -> None:
        """One endpoint's generation counter and running requests (and those `waiting` in its queue), read
        at `at`: a new point of the pool, and the waiters it is past called. A request a replica holds may
        wait in the engine's queue: the sequences no replica holds (`TallyPoint.lingering`) are those the
        engine runs or queues beyond the held ones (by its running count alone, each queued request hid a
        run-on)."""
        self._generated.observe(endpoint, counter)
        self._engine_running[endpoint] = running
        self._engine_waiting[endpoint] = waiting
        running = sum(self._engine_running.values())
        at = self._points.kept_at(at)
        ours, peers = self.figures(at), self.peers.fresh_at(at)
        held = ours.running + peers.running
        # Other replicas not heard from lately may run anything: no interval is taken for unshared then.
        live = held if self.peers.seen_at(at) else math.inf
        in_engine = running + sum(self._engine_waiting.values())
        point = TallyPoint(self._generated.total, running, max(0.0, min(running, in_engine - held)))
        self._points.add(at, point)
        shown = ours.shown + peers.shown
        ran = self._ran_since(self.run_ons.last_at, at, ours.seconds)
        share = _share(ours, peers)
        reading = Reading(at, point.generated, running, point.lingering, live, ran, share, shown)
        # The intervals read again wait for an answer of the others after the counts that waited for them:
        # each replica's part of them comes from the others' requests waiting (`RunFigures.left`).
        heard = self.peers.heard_after(self._counted_at)
        if heard:
            self._revise(share)
        self.run_ons.observe(reading, self._seconds_at if heard else None)
        self._wake(at)

    def _revise(self, share: float) -> None:
        """The shared intervals the run-ons kept read again where the other replicas' figures went back
        since the last reading (a stop told late: `PeerRuns._revise`)."""
        since, self.peers.revised_from = self.peers.revised_from, math.inf
        if since < math.inf:
            self.run_ons.revise(since, self._seconds_at, share)

    def _seconds_at(self, at: float) -> float:
        """Every replica's sequence-seconds by `at`, as known now."""
        return self.figures(at).seconds + self.peers.seconds_at(at)

    def _shown_at(self, at: float) -> float:
        """Every replica's sequences that may have run at `at` (`RunFigures.shown`), as known now."""
        return self.figures(at).shown + self.peers.shown_around(at)

    def _ran_since(self, since: float | None, at: float, ours: float) -> float:
        """The sequence-seconds every replica's runs ran from the last run-on reading (`since`) to `at`
        (`ours`: this sidecar's counter then), `since` read again now: the other replicas' figures heard
        after that reading hold their runs begun or stopped before it, the stops told late above all
        (`PeerRuns._revise`); read then, a run another replica had stopped just before made the interval
        after a flood's last stop shared, and its run-ons' steps went to no count."""
        if since is None:
            return 0.0
        return ours + self.peers.seconds_at(at) - self._seconds_at(since)

    def follow_run_on(
        self,
        key: Hashable,
        span: tuple[float, float],
        sequences: int,
        room: float,
        done: Callable[[float], None],
    ) -> None:
        """The request `key`, which ran over `span` (start, stop), was counted: `done(tokens)` gets what the
        engine ran on for it past its count, at most `room` (`runon.RunOns.follow`). Its baseline is the
        least lingering the points showed over `runon.RECENT_S` before its stop, its own time included:
        traffic sent around the gateway that runs throughout, never a run-on that started lately (nor an
        abort seen late at one reading). A `room` below zero (its count past its allowance) is the steps of
        others' run-ons it took: spilled to the requests waiting (`runon.RunOns.spill`)."""
        self.run_ons.spill(-room)
        points = self._points
        start, stop = span
        first = max(0, points.at_or_before(min(start, stop - RECENT_S)))
        during = points.items[first : points.at_or_before(stop) + 1]
        baseline = min((p.lingering for p in during), default=0.0)
        counted_to = stop + shown_after(ENGINE_STOP_S)  # its count's `_Window.shown_end`
        self.run_ons.follow(key, stop, counted_to, sequences, room, baseline, done)

    def forget(self, endpoint: str) -> None:
        """An endpoint left the feed (or its sample carries no counter): its next reading starts a new
        baseline. A failed scrape is not this: its counter stays (`FeedbackLoop._tally`)."""
        self._generated.forget(endpoint)
        self._engine_running.pop(endpoint, None)
        self._engine_waiting.pop(endpoint, None)

    def keep(self, endpoints: set[str]) -> None:
        """Forget every endpoint not in `endpoints` (the feed forgot it)."""
        self._generated.keep(endpoints)
        for endpoint in [e for e in self._engine_running if e not in endpoints]:
            del self._engine_running[endpoint]
            self._engine_waiting.pop(endpoint, None)

    def after(self, at: float, callback: Callable[[], None]) -> None:
        """Call `callback` once a point at or after `at` exists (at once if one does)."""
        if self._closed or self.covers(at):
            callback()
            return
        heapq.heappush(self._waiters, (at, next(self._order), callback))

    def charge(self, counted: float, floor: float) -> float:
        """A request's counted share as its charge, at least `floor` (`Lifts.charge`)."""
        return self._lifts.charge(counted, floor)

    def close(self) -> None:
        """The feed stopped (shutdown, a reload that restarts it): no point will come, so every waiter is
        called now, and any later one at once, and finds its count not covered."""
        self._closed = True
        waiters, self._waiters = self._waiters, []
        for _, _, callback in sorted(waiters):
            _call(callback)
        self.run_ons.close()

    def read_past(self, at: float) -> bool:
        """Whether a point at or after `at` exists (the other replicas heard by then or not: `covers`)."""
        last = self._points.last_at()
        return last is not None and last >= at

    def covers(self, at: float) -> bool:
        """Whether a point at or after `at` exists and the other replicas' runs are known by then
        (`PeerRuns.known_by`): a count on their last answer took their runs since for its own."""
        return self.read_past(at) and self.peers.known_by(at)

    def reaches_back(self, at: float) -> bool:
        """Whether a point at or before `at` is kept: a request that started then can be counted."""
        return self._points.at_or_before(at) >= 0

    def count(
        self, start: float, stop: float, sequences: int, tail: float = 0.0, key: Hashable | None = None
    ) -> float | None:
        """The tokens generated for a request of `sequences` that ran from `start` to `stop` and may have
        run `tail` seconds more (the engine finishing the step the abort found), per the module docstring;
        `key`, its own run among this sidecar's. None where the points kept do not reach from before
        `start` to `stop + tail`."""
        series = self._points
        first, last = series.at_or_before(start), series.at_or_after(stop + tail)
        if first < 0 or last >= len(series) or stop < start:
            return None
        shown_s = shown_after(tail)
        window = _Window(start, stop, stop + tail, stop + shown_s, max(1, sequences))
        times, points = series.times[first : last + 1], series.items[first : last + 1]
        known = self._known(times, key, shown_s)
        return sum(
            window.share(times[i], points[i], times[i + 1], points[i + 1], known[i])
            for i in range(len(points) - 1)
        )

    def _known(self, times: list[float], key: Hashable | None, shown_s: float) -> list[_Known]:
        """For each interval between `times`, this sidecar's other requests: the sequences that may be
        running at its start and end points (up to `shown_s` past their stop: the engine runs an aborted
        request on until the abort reaches it), and their sequence-seconds in it; the other replicas'
        runs (`PeerRuns`) among them."""
        peers = self.peers
        known = [
            _Known(peers.shown_at(t0), peers.shown_at(t1), peers.seconds_at(t1) - peers.seconds_at(t0))
            for t0, t1 in itertools.pairwise(times)
        ]
        lo_t, hi_t = times[0], times[-1]
        for run_key, run in self._runs.items():
            shown = run.until + shown_s
            if run_key == key or run.start >= hi_t or shown <= lo_t:
                continue
            first = max(0, bisect.bisect_right(times, run.start) - 1)
            last = min(len(known), bisect.bisect_left(times, shown))
            for i in range(first, last):
                interval = known[i]
                interval.seconds += run.sequences * run.overlap(times[i], times[i + 1])
                if run.start < times[i] < shown:
                    interval.at_start += run.sequences
                if run.start < times[i + 1] < shown:
                    interval.at_end += run.sequences
        return known

    def _wake(self, now: float) -> bool:
        """The waiters for a point at or before `now` called, where the other replicas' runs are known by
        then (the later ones wait on: a later time is known only if an earlier one is); whether any was."""
        waiters, called = self._waiters, False
        while waiters and waiters[0][0] <= now and self.peers.known_by(waiters[0][0]):
            _call(heapq.heappop(waiters)[2])
            called = True
        return called

    def __len__(self) -> int:
        return len(self._points)


def _share(ours: RunFigures, peers: RunFigures) -> float:
    """This replica's part of a run-on (`Reading.share`): its runs stopped lately and requests waiting
    against every replica's."""
    mine, theirs = ours.shown + ours.left, peers.shown + peers.left
    return mine / (mine + theirs) if mine + theirs > 0 else 1.0


def _call(callback: Callable[[], None]) -> None:
    try:
        callback()
    except Exception:
        log.exception("engine tally waiter failed")


@dataclass(slots=True)
class _Known:
    """This sidecar's other requests in one interval: sequences running at its two ends, and the
    sequence-seconds they ran in it."""

    at_start: float = 0.0
    at_end: float = 0.0
    seconds: float = 0.0


@dataclass(frozen=True, slots=True)
class _Window:
    """One request's time on the pool: from `start` to `stop`, perhaps running until `tail_end`, and perhaps
    run on until `shown_end` (`SHOWN_AFTER_STOP_S` past its stop, as its neighbours' runs and the run-ons
    take it: `runon.Reading.shown`; `_unknown_at_end`)."""

    start: float
    stop: float
    tail_end: float
    shown_end: float
    ours: int

    def share(self, t0: float, p0: TallyPoint, t1: float, p1: TallyPoint, known: _Known) -> float:
        """Our part of the tokens generated between two points: in proportion to the sequence-seconds we
        ran in it against the others'. The others this sidecar admitted ran as it saw them (`known`); the
        rest, the running count at each end less ours where we may have run then and the known ones,
        averaged over the interval. Past `stop`, the step the abort found, read after the end (`_tail`)."""
        generated = p1.generated - p0.generated
        if generated <= 0.0:
            return 0.0
        if t0 >= self.stop:
            return self._tail(t0, p0, t1, p1, known, generated)
        ran = min(t1, self.stop) - max(t0, self.start)
        if ran <= 0.0:
            return 0.0
        unknown0 = self._unknown(t0, p0, known.at_start)
        unknown = (unknown0 + self._unknown_at_end(t1, p1, known.at_end, unknown0)) / 2
        ours_s = self.ours * ran
        return generated * ours_s / (known.seconds + unknown * (t1 - t0) + ours_s)

    def _unknown_at_end(self, t1: float, p1: TallyPoint, known: float, unknown0: float) -> float:
        """The unknown sequences at the end of the interval our stop falls in. Past `tail_end`, ours are
        still taken for running (until `shown_end`) as far as the running count grew by them: the engine
        runs an aborted request on until the abort reaches it, and on a slow feed that reading comes seconds
        after the stop; taken for another's, their steps went uncharged (a clean-clone CI run charged a
        stream 3,719 of the 3,759 tokens vLLM decoded)."""
        if not self.tail_end <= t1 < self.shown_end:
            return self._unknown(t1, p1, known)
        others = max(0.0, p1.running - known)
        return others - min(float(self.ours), max(0.0, others - unknown0))

    def _tail(
        self, t0: float, p0: TallyPoint, t1: float, p1: TallyPoint, known: _Known, generated: float
    ) -> float:
        """An interval after `stop`, starting before `tail_end`: ours where the reading at its start shows
        our sequences still running (no more running than ours beside the known others) and the one at its
        end the engine idle, in proportion to the known others' time in it; else nothing."""
        unknown = p0.running - known.at_start
        if t0 >= self.tail_end or p1.running != 0 or not 0 < unknown <= self.ours:
            return 0.0
        ours_s = self.ours * (t1 - t0) / 2
        return generated * ours_s / (known.seconds + ours_s)

    def _unknown(self, at: float, point: TallyPoint, known: float) -> float:
        ours_then = self.start < at < self.tail_end
        return max(0.0, point.running - (self.ours if ours_then else 0) - known)
