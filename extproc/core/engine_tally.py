"""What a pool's engines generated for one request whose answer nobody saw, from their generation counters.

A non-streamed answer whose client left, or a request whose end report never came, passed no token through
the proxy: the sidecar must estimate what the engine generated for it. A pace times its time errs by the
pace: one learned from single answers is not what each of `n` sequences decoded together runs at (on the
real-engine tier an n=4 answer left after 1.5 s was charged 1.10 to 1.29 times what vLLM counted, 2.1 to 3.3
on another host). The engines count it themselves: the feed carries each endpoint's generation-token counter
(vLLM's `vllm:generation_tokens_total`) with its running requests, and `EngineTally` keeps, per pool, the
sum of the counters' growth and of the running sequences at each sample (`TallyPoint`).

`count(start, stop, sequences, tail)` is a request's share of that growth over its time: in each interval
between two points, the tokens generated split in proportion to the sequence-seconds each request ran.
Ours is `sequences` over the part of the interval inside [start, stop]; the others' is the running count
at the interval's two ends, less ours where we ran then: those at both ends ran all of it, those who came
or went inside it as long as we did where we came or went in it too (requests that start or end together,
a burst), else half of it. Alone on the pool the others' share is 0 and the count is every token the
engines generated from the point before `start` to the first point after `stop` (and up to `tail` later,
while the engine finished the step the abort found and then ran nothing), exact whatever the scrape
interval; among others it is the pool's mean pace per sequence over our own time. A request queued in the
engine counts as running (the feed's running count does not show it): it errs high, as the pace estimate
does. One that started and ended between two points is invisible to their running counts: its tokens
count as those the points show running.

A count needs a point at or before `start` and one at or after `stop + tail`: the caller waits for the latter
(`after(t, callback)`, called at the first point at or after `t`). Points are read at the sidecar's clock
when the sample arrived less the scrape's duration (the counters were read no earlier). Memory is bounded:
at most `max_points` per pool, one per `min_spacing_s` (a newer one replaces a last one that came
sooner), 20,000 at 0.1 s, over half an hour at ten samples a second: a request older than the points kept
gets no count (None), and the caller charges its pace estimate. An endpoint whose counter goes back (a
restart) starts a new baseline; one gone from the feed (`forget`) leaves the sum as it was.

Pure: no clock, no I/O; the feed's loop calls `observe` on its event loop, admission reads `count`.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)

MAX_POINTS = 20_000
MIN_SPACING_S = 0.1


@dataclass(frozen=True, slots=True)
class TallyPoint:
    """The pool at one reading: `generated` tokens since the tally began, `running` sequences then."""

    at: float
    generated: float
    running: float


class EngineTally:
    """One pool's generation counters over time (see the module docstring)."""

    def __init__(self, max_points: int = MAX_POINTS, min_spacing_s: float = MIN_SPACING_S) -> None:
        self.max_points = max_points
        self.min_spacing_s = min_spacing_s
        self._points: list[TallyPoint] = []
        self._times: list[float] = []  # `at` of each point, for bisect
        self._endpoints: dict[str, tuple[float, float]] = {}  # endpoint -> (counter, running) last read
        self._generated = 0.0
        self._waiters: list[tuple[float, int, Callable[[], None]]] = []
        self._order = itertools.count()

    def observe(self, endpoint: str, counter: float, running: float, at: float) -> None:
        """One endpoint's generation counter and running requests, read at `at`: a new point of the pool,
        and the waiters it is past called."""
        before = self._endpoints.get(endpoint)
        self._endpoints[endpoint] = (counter, running)
        if before is not None and counter >= before[0]:
            self._generated += counter - before[0]
        running_now = sum(r for _, r in self._endpoints.values())
        at = max(at, self._times[-1]) if self._times else at  # samples arrive in order; their scrapes vary
        point = TallyPoint(at, self._generated, running_now)
        times = self._times
        if len(times) > 1 and times[-1] - times[-2] < self.min_spacing_s:
            self._points[-1], times[-1] = point, at  # the last one came too soon after its predecessor
        else:
            self._points.append(point)
            times.append(at)
        if len(self._points) > self.max_points:
            drop = len(self._points) - self.max_points * 3 // 4
            del self._points[:drop], self._times[:drop]
        self._wake(self._times[-1])

    def forget(self, endpoint: str) -> None:
        """An endpoint left the feed (or its scrape failed): its next reading starts a new baseline."""
        self._endpoints.pop(endpoint, None)

    def keep(self, endpoints: set[str]) -> None:
        """Forget every endpoint not in `endpoints` (the feed forgot it)."""
        for endpoint in [e for e in self._endpoints if e not in endpoints]:
            del self._endpoints[endpoint]

    def after(self, at: float, callback: Callable[[], None]) -> None:
        """Call `callback` once a point at or after `at` exists (at once if one does)."""
        if self._times and self._times[-1] >= at:
            callback()
            return
        heapq.heappush(self._waiters, (at, next(self._order), callback))

    def covers(self, at: float) -> bool:
        """Whether a point at or after `at` exists."""
        return bool(self._times) and self._times[-1] >= at

    def reaches_back(self, at: float) -> bool:
        """Whether a point at or before `at` is kept: a request that started then can be counted."""
        return bool(self._times) and self._times[0] <= at

    def count(self, start: float, stop: float, sequences: int, tail: float = 0.0) -> float | None:
        """The tokens generated for a request of `sequences` that ran from `start` to `stop` and may have
        run `tail` seconds more (the engine finishing the step the abort found), per the module docstring;
        None where the points kept do not reach from before `start` to `stop + tail`."""
        times = self._times
        first = bisect.bisect_right(times, start) - 1
        last = bisect.bisect_left(times, stop + tail)
        if first < 0 or last >= len(times) or stop < start:
            return None
        points = self._points
        window = _Window(start, stop, stop + tail, max(1, sequences))
        return sum(window.share(points[i], points[i + 1]) for i in range(first, last))

    def _wake(self, now: float) -> None:
        waiters = self._waiters
        while waiters and waiters[0][0] <= now:
            _, _, callback = heapq.heappop(waiters)
            try:
                callback()
            except Exception:
                log.exception("engine tally waiter failed")

    def __len__(self) -> int:
        return len(self._points)


@dataclass(frozen=True, slots=True)
class _Window:
    """One request's time on the pool: from `start` to `stop`, perhaps running until `tail_end`."""

    start: float
    stop: float
    tail_end: float
    ours: int

    def share(self, p0: TallyPoint, p1: TallyPoint) -> float:
        """Our part of the tokens generated between two points: in proportion to the sequence-seconds we
        ran in it against the others' (the running count at each end, less ours where we may have run
        then: those at both ends ran all of it). Past `stop`, all of an interval at whose end the engine
        ran nothing and at whose start no more than ours ran: the step the abort found, read after the
        end; else nothing."""
        generated = p1.generated - p0.generated
        if generated <= 0.0:
            return 0.0
        if p0.at >= self.stop:
            return generated if p1.running == 0 and p0.running <= self.ours else 0.0
        ran = min(p1.at, self.stop) - max(p0.at, self.start)
        if ran <= 0.0:
            return 0.0
        span = p1.at - p0.at
        before, after = self._others(p0), self._others(p1)
        # Others who came or went inside the interval ran, each, as long in it as we did where we came or
        # went in it too (a burst starts and ends together), else half of it (arrivals spread over it).
        edge = p0.at < self.start or self.stop < p1.at
        changed = abs(after - before) * (ran if edge else span / 2)
        ours_s = self.ours * ran
        return generated * ours_s / (min(before, after) * span + changed + ours_s)

    def _others(self, point: TallyPoint) -> float:
        ours_then = self.start < point.at < self.tail_end
        return max(0.0, point.running - (self.ours if ours_then else 0))
