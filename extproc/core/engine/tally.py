"""What a pool's engines generated for one request whose answer was not seen whole, from their counters.

A non-streamed answer whose client left, or a request whose end report never came, passed no token through
the proxy, and a stream left mid-answer passed fewer than the engine generated before the abort reached it:
the sidecar must estimate what the engine generated for it. A pace times its time errs by the
pace: one learned from single answers is not what each of `n` sequences decoded together runs at (on the
real-engine tier an n=4 answer left after 1.5 s was charged 1.10 to 1.29 times what vLLM counted, 2.1 to 3.3
on another host). The engines count it themselves: the feed carries each endpoint's generation-token counter
(vLLM's `vllm:generation_tokens_total`) with its running requests, and `EngineTally` keeps, per pool, the
sum of the counters' growth and of the running sequences at each sample (`TallyPoint`).

`count(key)` is a run's share of that growth over its time: in each interval between two points, the tokens
generated split in proportion to the sequence-seconds each request ran. This sidecar's runs ran as it saw
them (`begin` at its admission, `end` when its request ended here), then on as long as the engine ran them
(`run_on`: each reading's running count less every replica's runs in flight is taken for the foreign
sequences it held before, then for the stopped runs still open, newest first, then for unknown ones); the
other replicas' runs as their figures say (`peers`); the unknown sequences (requests no gateway admitted)
as the readings found them, along the line between two. So the steps an engine ran after a client left, a
whole answer where it missed the abort (vLLM #54947), are charged to the runs that stopped, capped by their
allowances, with one replica as with several, and every replica's shares of the pool's growth sum to it
but for the unknown sequences' part. In process, a flood of 36 streams with two aborts missed (the engine
decoding on 15 s) was counted 1.000 over one replica and 0.994 over two; before, the steps past 5 s after a
stop went to nobody: 0.781 and 0.806. A request queued in the engine counts as running (the feed's running
count does not show it), as does the time between its admission and its first step: beside unknown others
it errs high, as the pace estimate does. An unknown one that started and ended between two points is
invisible to their running counts: its tokens count as those the points show running. The split takes
every running sequence to decode at one pace (nearly so on a GPU; on a CPU engine a sequence among eight
runs at a fraction of one alone).

A count needs a point at or before the run's start and the one that found the engine done with it: the
caller waits for the latter (`when_done`). Points are read at the sidecar's clock when the sample arrived
less the scrape's duration (the counters were read no earlier). Memory is bounded (`series.Series`, as for
the other replicas' runs): at most `max_points` per pool, one per `min_spacing_s` (a newer one replaces a
last one that came sooner), 20,000 at 0.1 s, over half an hour at ten samples a second: a request older
than the points kept gets no count (None), and the caller charges its pace estimate. An endpoint whose
counter goes back (a restart) starts a new baseline; one gone from the feed (`forget`) leaves the sum as it
was. Runs: every request in flight here, and the last `MAX_ENDED_RUNS` ended (20,000: older ones count
among the unknown), none begun over `MAX_RUN_S` (two hours) before the newest.

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
from dataclasses import dataclass, field

from extproc.core.engine.peers import PeerRuns, RunFigures
from extproc.core.engine.run_on import SHOWN_AFTER_STOP_S, Reading, Room, Run, RunOn
from extproc.core.engine.series import Series

__all__ = ["EngineTally", "RunFigures", "TallyPoint", "no_tally"]

log = logging.getLogger(__name__)

MAX_POINTS = 20_000
MIN_SPACING_S = 0.1
MAX_ENDED_RUNS = 20_000
MAX_RUN_S = 7200.0  # past any request's lifetime bound (`admission.max_request_seconds`, 1,800 s by default)
MAX_LIFTED = 100_000.0
"""The most tokens of shares lifted to their floors the pool holds to be paid back (`EngineTally.charge`):
past a flood's worth, so a split that errs low for long (beside another replica's requests) cannot take
more than that off later shares."""


def no_tally(pool: str) -> EngineTally | None:
    """No feed: no pool has a tally (what admission asks before the feed is wired)."""
    return None


@dataclass(frozen=True, slots=True)
class TallyPoint:
    """The pool at one reading (its time kept by the `Series`): `generated` tokens since the tally began,
    `running` sequences then, and what of them no replica held in flight (`run_on.Room`)."""

    generated: float
    running: float
    room: Room = field(default_factory=Room)


class EngineTally:
    """One pool's generation counters over time (see the module docstring)."""

    def __init__(self, max_points: int = MAX_POINTS, min_spacing_s: float = MIN_SPACING_S) -> None:
        self._points: Series[TallyPoint] = Series(max_points, min_spacing_s)
        self._endpoints: dict[str, tuple[float, float]] = {}  # endpoint -> (counter, running) last read
        self._generated = 0.0
        self._waiters: list[tuple[float, int, Callable[[], None]]] = []
        self._done_waiters: dict[Hashable, list[tuple[float, Callable[[], None]]]] = {}
        self._order = itertools.count()
        self._closed = False  # the feed stopped: waiters are called at once
        self._lifted = 0.0  # shares lifted to their floors, not yet paid back by later shares
        self._runs: dict[Hashable, Run] = {}  # this sidecar's requests in the pool, by lease
        self._in_flight: dict[Hashable, Run] = {}  # of them, those not ended
        self._ended: deque[Hashable] = deque()  # the ended ones, oldest first, at most `MAX_ENDED_RUNS`
        self._run_on = RunOn()  # the ended ones the engine may still run
        self.peers = PeerRuns(max_points, min_spacing_s)  # the other replicas' runs (`observe_peers`)
        # This sidecar's runs summed for `figures`: the sequence-seconds of the ended ones, and the running
        # ones' sequences and sequences times start (their seconds by `now`: sequences x now less that).
        self._ended_seconds = 0.0
        self._running = 0
        self._running_starts = 0.0

    def begin(self, key: Hashable, start: float, sequences: int, allowance: float = math.inf) -> None:
        """This sidecar admitted a request of `sequences` into the pool at `start` (`key`: its lease), which
        may generate `allowance` tokens at most. Runs begun over `MAX_RUN_S` before go, ended or not: no
        request lives that long, and one never ended (a bug elsewhere) must not count as running forever."""
        stale = []
        for old_key, run in self._runs.items():
            if run.start >= start - MAX_RUN_S:
                break
            stale.append(old_key)
        for old_key in stale:
            self._forget_run(old_key)
        self._forget_run(key)
        run = self._runs[key] = self._in_flight[key] = Run(key, start, max(1, sequences), allowance)
        self._running += run.sequences
        self._running_starts += run.sequences * start

    def _forget_run(self, key: Hashable) -> None:
        """A run forgotten: if it was running, out of the running sums (its seconds go uncounted)."""
        run = self._runs.pop(key, None)
        self._run_on.forget(key)
        if run is not None and self._in_flight.pop(key, None) is not None:
            self._running -= run.sequences
            self._running_starts -= run.sequences * run.start

    def end(self, key: Hashable, stop: float) -> None:
        """The request `key` ended at `stop` here; once. The engine may run it on (`run_on`)."""
        run = self._in_flight.pop(key, None)
        if run is None:
            return
        run.stop = max(stop, run.start)
        self._running -= run.sequences
        self._running_starts -= run.sequences * run.start
        self._ended_seconds += run.sequences * (run.stop - run.start)
        self._run_on.stopped(run)
        self._ended.append(key)
        while len(self._ended) > MAX_ENDED_RUNS:
            self._forget_run(self._ended.popleft())

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

    def running_on(self, key: Hashable) -> bool:
        """Whether the request `key` ended here and the engine may still run it (no reading found it done)."""
        run = self._runs.get(key)
        return run is not None and run.stop is not None and run.done is None

    def figures(self, now: float) -> RunFigures:
        """This sidecar's runs as the other replicas' tallies need them (`RunFigures`), at `now`: what it
        publishes through the shared store."""
        seconds = self._ended_seconds + self._running * now - self._running_starts
        running = float(self._running)
        return RunFigures(max(0.0, seconds), running, running + self._recent(now))

    def _recent(self, at: float) -> float:
        """This sidecar's sequences stopped by `at` that the engine may still run, as the room's split
        between the replicas counts them (`run_on.Reading`): those stopped within `SHOWN_AFTER_STOP_S`, and
        older ones the last reading found running."""
        since, recent = at - SHOWN_AFTER_STOP_S, 0.0
        for key in reversed(self._ended):  # ended in order; a stop moved later by `ran_until` is rare
            run = self._runs.get(key)
            if run is None or run.until <= since - SHOWN_AFTER_STOP_S:
                break
            if since < run.until <= at:
                recent += run.sequences
        return recent + self._run_on.held(since)

    def observe_peers(self, replicas: Mapping[str, RunFigures], at: float) -> None:
        """The other live replicas' figures of the pool, read from the store at `at` (`PeerRuns`)."""
        self.peers.observe(replicas, at)

    def observe(self, endpoint: str, counter: float, running: float, at: float) -> None:
        """One endpoint's generation counter and running requests, read at `at`: a new point of the pool,
        its room taken (`run_on`), and the waiters it is past called."""
        before = self._endpoints.get(endpoint)
        self._endpoints[endpoint] = (counter, running)
        if before is not None and counter >= before[0]:
            self._generated += counter - before[0]
        running_now = sum(r for _, r in self._endpoints.values())
        points = self._points
        if points.replaces_last():
            self._run_on.undo(points.times[-2])
        at = max(at, points.times[-1]) if len(points) else at
        room = self._run_on.read(self._reading(at, running_now))
        self._wake(points.add(at, TallyPoint(self._generated, running_now, room)))

    def _reading(self, at: float, running: float) -> Reading:
        """The reading at `at` as the room needs it (`run_on.Reading`): every replica's runs in flight then
        and stopped lately, this one's counted when the others' figures were read (their figures are as old:
        counted now, ours would take more than its part while a flood starts), and the tokens a sequence
        generated a second since the point before (the last one kept)."""
        points = self._points
        n = len(points) - 1 if points.replaces_last() else len(points)
        pace = 0.0
        if n > 0:
            t0, p0 = points.times[n - 1], points.items[n - 1]
            sequence_s = (p0.running + running) / 2 * (at - t0)
            pace = (self._generated - p0.generated) / sequence_s if sequence_s > 0 else 0.0
        ours = sum(r.sequences for r in self._in_flight.values() if r.start < at)
        ours += sum(r.sequences for r in self._run_on.open.values() if r.start < at < r.until)
        others = self.peers.at(at)
        others_recent = max(0.0, others.shown - others.running)
        read = self.peers.read_at(at)
        ours_recent = self._recent(at if read is None else read)
        return Reading(at, running, ours, others.running, ours_recent, others_recent, pace)

    def forget(self, endpoint: str) -> None:
        """An endpoint left the feed (or its scrape failed): its next reading starts a new baseline."""
        self._endpoints.pop(endpoint, None)

    def keep(self, endpoints: set[str]) -> None:
        """Forget every endpoint not in `endpoints` (the feed forgot it)."""
        for endpoint in [e for e in self._endpoints if e not in endpoints]:
            del self._endpoints[endpoint]

    def after(self, at: float, callback: Callable[[], None]) -> None:
        """Call `callback` once a point at or after `at` exists (at once if one does)."""
        if self._closed or self.covers(at):
            callback()
            return
        heapq.heappush(self._waiters, (at, next(self._order), callback))

    def when_done(self, key: Hashable, at: float, callback: Callable[[], None]) -> None:
        """Call `callback` once a point at or after `at` exists and the request `key` ended here and no
        longer runs on (`running_on`), or is not kept: its count is then final (at once if it is)."""
        if self._closed or (self.covers(at) and not self.running_on(key)):
            callback()
            return
        self._done_waiters.setdefault(key, []).append((at, callback))

    def charge(self, counted: float, floor: float) -> float:
        """A request's counted share as its charge, at least `floor` (the tokens that passed: the engines
        generated them for certain). A share under its floor took what the split gave its neighbours, so it
        is lifted and the pool owes the difference; the next shares over their floors pay it back, never
        below their own floors, and a flood's charges still sum to the engines' count (at most
        `MAX_LIFTED` owed)."""
        if counted < floor:
            self._lifted = min(MAX_LIFTED, self._lifted + floor - counted)
            return floor
        repaid = min(self._lifted, counted - floor)
        self._lifted -= repaid
        return counted - repaid

    def close(self) -> None:
        """The feed stopped (shutdown, a reload that restarts it): no point will come, so every waiter is
        called now, and any later one at once, and finds its count not covered."""
        self._closed = True
        waiters, self._waiters = self._waiters, []
        done_waiters, self._done_waiters = self._done_waiters, {}
        for _, _, callback in sorted(waiters):
            _call(callback)
        for callbacks in done_waiters.values():
            for _, callback in callbacks:
                _call(callback)

    def covers(self, at: float) -> bool:
        """Whether a point at or after `at` exists."""
        last = self._points.last_at()
        return last is not None and last >= at

    def reaches_back(self, at: float) -> bool:
        """Whether a point at or before `at` is kept: a request that started then can be counted."""
        return self._points.at_or_before(at) >= 0

    def count(self, key: Hashable) -> float | None:
        """The tokens generated for the request `key` from its start to the point that found the engine done
        with it (to the last point while it runs on), per the module docstring. None where it is not kept
        or the points kept do not reach back to its start."""
        run = self._runs.get(key)
        series = self._points
        if run is None or series.at_or_before(run.start) < 0:
            return None
        first = series.at_or_before(run.start)
        last = len(series) - 1 if run.done is None else min(len(series) - 1, series.at_or_after(run.done))
        split = _Split(series.times[first : last + 1], series.items[first : last + 1], run)
        for other in self._runs.values():
            split.add(other)
        return split.count(self.peers)

    def _wake(self, now: float) -> None:
        waiters = self._waiters
        while waiters and waiters[0][0] <= now:
            _call(heapq.heappop(waiters)[2])
        for key in [k for k, w in self._done_waiters.items() if not self.running_on(k)]:
            ready = [w for w in self._done_waiters[key] if w[0] <= now]
            rest = [w for w in self._done_waiters[key] if w[0] > now]
            if rest:
                self._done_waiters[key] = rest
            else:
                del self._done_waiters[key]
            for _, callback in ready:
                _call(callback)

    def __len__(self) -> int:
        return len(self._points)


class _Split:
    """A run's count over the points of its window: for each interval between two, the sequence-seconds it
    ran there and those of every other sequence the engines ran there (this sidecar's other runs, the other
    replicas' and the unknown ones), and its share of the tokens generated there by them."""

    def __init__(self, times: list[float], points: list[TallyPoint], run: Run) -> None:
        n = len(times) - 1
        self.times, self.points, self.run = times, points, run
        self.ours, self.others = [0.0] * n, [0.0] * n
        # After their stops, what each of this sidecar's runs ran on by `Run.seconds_on`, else by what the
        # points found of it: [the counted run's, the others'], for sharing the run-on among them.
        self.weighed, self.fallback = ([[0.0] * n, [0.0] * n] for _ in range(2))
        self.found = [0.0] * (n + 1)  # this sidecar's stopped sequences each point found running

    def add(self, other: Run) -> None:
        """One of this sidecar's runs (the counted one too): in flight as it ran, on as the points found."""
        times, n = self.times, len(self.times) - 1
        if other.start >= times[-1] or other.active_until <= times[0]:
            return
        mine = int(other is not self.run)
        into = self.ours if mine == 0 else self.others
        first = max(0, bisect.bisect_right(times, other.start) - 1)
        last = min(n, bisect.bisect_left(times, other.active_until))
        on = [other.on_at(times[i], self.points[i].room.ours) for i in range(first, last + 1)]
        after = [on[i - first] if other.until <= times[i] else 0.0 for i in range(first, last + 1)]
        for i in range(first, last):
            t0, t1, k = times[i], times[i + 1], i - first
            into[i] += other.sequences * other.overlap(t0, t1)
            self.weighed[mine][i] += other.seconds_on(t0, on[k], t1, on[k + 1])
            self.fallback[mine][i] += after[k] + after[k + 1]
        for i in range(first, last + 1):
            self.found[i] += after[i - first]

    def count(self, peers: PeerRuns) -> float:
        """The run's share of each interval's tokens, summed, once every run of this sidecar is added. The
        sequence-seconds run on after their stops are along the line between what the points found, ours
        and the other replicas' alike (as they see ours), ours shared among our stopped runs by `weighed`
        (`fallback` where none weighs); the unknown sequences' too; the other replicas' in flight by their
        figures (`PeerRuns`)."""
        counted = 0.0
        for i, ((t0, p0), (t1, p1)) in enumerate(
            itertools.pairwise(zip(self.times, self.points, strict=True))
        ):
            run_on = (self.found[i] + self.found[i + 1]) / 2 * (t1 - t0)
            weights = self.weighed if self.weighed[0][i] + self.weighed[1][i] > 0 else self.fallback
            mine, rest = weights[0][i], weights[1][i]
            ours = self.ours[i] + (run_on * mine / (mine + rest) if mine + rest > 0 else 0.0)
            room = (p0.room.others + p1.room.others + p0.room.unknown + p1.room.unknown) / 2 * (t1 - t0)
            in_flight = peers.seconds_at(t1) - peers.seconds_at(t0)
            others = self.ours[i] + self.others[i] + run_on + room + in_flight - ours
            generated = p1.generated - p0.generated
            if generated > 0.0 and ours > 0.0:
                counted += generated * ours / (ours + others)
        return counted


def _call(callback: Callable[[], None]) -> None:
    try:
        callback()
    except Exception:
        log.exception("engine tally waiter failed")
