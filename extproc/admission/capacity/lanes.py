"""Fair use of the tokenizer threads: one client's flood of large prompts cannot delay anybody else.

Counting a large prompt takes a worker thread for up to tens of milliseconds. Without care, a client that
sends megabyte bodies fills every thread and every other tenant's large prompt queues behind them until the
proxy's message timer fires (504). So work is queued per lane (a tenant, or an anonymous client's address):

* a lane runs at most `per_lane` jobs at a time;
* free threads are handed to waiting lanes in turn (round robin), so a newcomer waits for at most one job
  per thread, whatever the backlog of a flooding lane;
* a lane's jobs wait at most `max_wait_s` for their turn, so a refusal comes before the proxy's message
  timeout (504). A job whose lane's backlog is forecast to take longer than that, at the lane's own job
  times while it is busy, is refused at once rather than after the wait (`LaneFull`), and so is one past
  `backlog` waiting jobs or `backlog_bytes` of their bodies (what a flood of large bodies holds). Every
  refusal carries the moment the lane's backlog is forecast to have drained to what a job may wait behind.

A lane's backlog is its own client's work, so it may be long: a tenant's burst of forty 10 KB prompts (an
SDK's `asyncio.gather`) takes under a millisecond each and waits its turns; only a backlog that cannot start
in time is refused. Small prompts never come here: they are counted on the event loop (see
`AdmissionService.count_prompts`).
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from extproc.admission.intake.rules import Tokenizing
from extproc.core.clock import Clock, monotonic

T = TypeVar("T")

FIRST_JOB_S = 0.01
"""The job time a refusal's hint assumes before any job has been timed: a 100 KB prompt counted at 10 MB/s,
a third of tiktoken's pace on one idle core of the two-core test host (30 MB/s measured). No job is refused
on it: a lane is refused ahead of its wait only on its own job times."""
LEARN = 0.3
"""The weight of a job's time in its lane's running mean: a burst's first few jobs set it."""


class LaneFull(Exception):
    """The client's large prompts waiting to be counted would not start in time: `retry_after_s` is when its
    lane's backlog is forecast to have drained enough."""

    def __init__(self, lane: str, retry_after_s: float) -> None:
        super().__init__(lane)
        self.lane = lane
        self.retry_after_s = retry_after_s


@dataclass(eq=False)
class Lanes:
    executor: Executor | None
    threads: int
    per_lane: int = 1
    backlog: int = 64
    max_wait_s: float = 0.5
    backlog_bytes: int = 4 << 20
    clock: Clock = monotonic
    _running: dict[str, int] = field(default_factory=dict)
    _waiting: OrderedDict[str, deque[asyncio.Future[None]]] = field(default_factory=OrderedDict)
    _waiting_bytes: dict[str, int] = field(default_factory=dict)
    _job_s: dict[str, float] = field(default_factory=dict)  # busy lanes' mean job time
    _any_job_s: float = FIRST_JOB_S  # every lane's, the start of a newly busy lane's
    _total: int = 0

    def configure(self, rules: Tokenizing) -> None:
        self.per_lane, self.backlog = rules.per_client, rules.backlog_per_client
        self.max_wait_s, self.backlog_bytes = rules.max_wait_seconds, rules.backlog_bytes_per_client
        self._dispatch()

    async def run(self, lane: str, size: int, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn(*args)`, the work on a body of `size` bytes, on a worker thread when the lane's turn
        comes; LaneFull if it would not come in time."""
        await self._enter(lane, size)
        started = self.clock()
        try:
            return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)
        finally:
            self._learn(lane, self.clock() - started)
            self._leave(lane)

    async def _enter(self, lane: str, size: int) -> None:
        if lane not in self._waiting and self._can_start(lane):
            # Waiting lanes that could start have been started already: this one is not overtaking.
            self._start(lane)
            return
        queue = self._waiting.get(lane)
        waiting = 0 if queue is None else len(queue)
        held = self._waiting_bytes.get(lane, 0)
        if waiting >= self.backlog or held + size > self.backlog_bytes or self._too_late(lane):
            raise LaneFull(lane, self.drained_in_s(lane))
        if queue is None:
            queue = self._waiting[lane] = deque()
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        queue.append(turn)
        self._waiting_bytes[lane] = held + size
        self._dispatch()
        try:
            await self._wait(lane, turn, size)
        except (asyncio.CancelledError, TimeoutError) as exc:
            if turn.done() and not turn.cancelled():
                self._leave(lane)  # started in the same instant the caller left: give the thread back
            else:
                turn.cancel()
                self._forget(lane, turn)
            if isinstance(exc, TimeoutError):
                raise LaneFull(lane, self.drained_in_s(lane)) from None
            raise

    async def _wait(self, lane: str, turn: asyncio.Future[None], size: int) -> None:
        """Wait for the lane's turn, its body counted as waiting until the turn comes or the wait ends."""
        try:
            await asyncio.wait_for(asyncio.shield(turn), self.max_wait_s)
        finally:
            _lower(self._waiting_bytes, lane, size)

    def forecast_s(self, lane: str) -> float:
        """Seconds until a job joining `lane` now is forecast to start: the lane's waiting jobs, and its
        running ones half done, at the lane's mean job time, on its share of the threads (busy lanes take
        turns)."""
        queue = self._waiting.get(lane)
        ahead = (0 if queue is None else len(queue)) + self._running.get(lane, 0) / 2
        busy = len(self._running.keys() | self._waiting.keys() | {lane})
        share = min(self.per_lane, self.threads / busy)
        return ahead * self._job_s.get(lane, self._any_job_s) / share

    def _too_late(self, lane: str) -> bool:
        """Whether a job joining `lane` would not start within `max_wait_s`, forecast only from the lane's own
        job times: before one of its jobs ends, the wait itself is the bound."""
        return lane in self._job_s and self.forecast_s(lane) > self.max_wait_s

    def drained_in_s(self, lane: str) -> float:
        """When the lane's backlog is forecast to leave a newcomer at most `max_wait_s` to wait: at least
        one of its jobs' time."""
        one = self._job_s.get(lane, self._any_job_s) / min(self.per_lane, self.threads)
        return max(self.forecast_s(lane) - self.max_wait_s, one)

    def free(self, lane: str) -> bool:
        """Whether a job of `lane` would start now, waiting behind nothing."""
        return lane not in self._waiting and self._can_start(lane)

    def _learn(self, lane: str, seconds: float) -> None:
        self._any_job_s += LEARN * (seconds - self._any_job_s)
        mean = self._job_s.get(lane)
        self._job_s[lane] = seconds if mean is None else mean + LEARN * (seconds - mean)

    def _can_start(self, lane: str) -> bool:
        return self._total < self.threads and self._running.get(lane, 0) < self.per_lane

    def _start(self, lane: str) -> None:
        self._total += 1
        self._running[lane] = self._running.get(lane, 0) + 1

    def _leave(self, lane: str) -> None:
        self._total -= 1
        _lower(self._running, lane, 1)
        self._dispatch()
        self._idle(lane)

    def _idle(self, lane: str) -> None:
        """A lane with nothing running or waiting forgets its job time (the memory is per busy lane)."""
        if lane not in self._running and lane not in self._waiting:
            self._job_s.pop(lane, None)

    def _forget(self, lane: str, turn: asyncio.Future[None]) -> None:
        queue = self._waiting.get(lane)
        if queue is not None and turn in queue:
            queue.remove(turn)
            if not queue:
                del self._waiting[lane]
        self._idle(lane)

    def _dispatch(self) -> None:
        """Hand free threads to waiting lanes in turn; a lane that starts a job goes to the back."""
        progressed = True
        while progressed and self._total < self.threads and self._waiting:
            progressed = False
            for lane in list(self._waiting):
                queue = self._waiting[lane]
                if not self._can_start(lane):
                    continue
                turn = queue.popleft()
                if turn.done():  # its caller left; `_forget` finds it gone
                    if not queue:
                        del self._waiting[lane]
                    progressed = True
                    break
                if not queue:
                    del self._waiting[lane]
                else:
                    self._waiting.move_to_end(lane)
                self._start(lane)
                turn.set_result(None)
                progressed = True
                break

    @property
    def queued(self) -> int:
        return sum(len(q) for q in self._waiting.values())

    @property
    def running(self) -> int:
        return self._total


def _lower(counts: dict[str, int], lane: str, by: int) -> None:
    """Take `by` off `lane`'s count, forgetting the lane at zero (a lane's entry exists only while busy)."""
    left = counts[lane] - by
    if left:
        counts[lane] = left
    else:
        del counts[lane]
