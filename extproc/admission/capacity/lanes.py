"""Fair use of the tokenizer threads: one client's flood of large prompts cannot delay anybody else.

Counting a large prompt takes a worker thread for up to tens of milliseconds. Without care, a client that
sends megabyte bodies fills every thread and every other tenant's large prompt queues behind them until the
proxy's message timer fires (504). So work is queued per lane (a tenant, or an anonymous client's address):

* a lane runs at most `per_lane` jobs at a time;
* free threads are handed to waiting lanes in turn (round robin), so a newcomer waits for at most one job
  per thread, whatever the backlog of a flooding lane;
* a lane may queue at most `backlog` jobs, each for at most `max_wait_s`; beyond either the caller is
  refused (`LaneFull`), with a retry hint, instead of waiting into the proxy's message timeout (504).

Small prompts never come here: they are counted on the event loop (see `AdmissionService.count_prompts`).
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, TypeVar

T = TypeVar("T")


class LaneFull(Exception):
    """The lane's backlog is full: the client has too many large prompts waiting to be counted."""


@dataclass(eq=False)
class Lanes:
    executor: Executor | None
    threads: int
    per_lane: int = 1
    backlog: int = 4
    max_wait_s: float = 0.5
    _running: dict[str, int] = field(default_factory=dict)
    _waiting: OrderedDict[str, deque[asyncio.Future[None]]] = field(default_factory=OrderedDict)
    _total: int = 0

    def configure(self, per_lane: int, backlog: int, max_wait_s: float) -> None:
        self.per_lane, self.backlog, self.max_wait_s = per_lane, backlog, max_wait_s
        self._dispatch()

    async def run(self, lane: str, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn(*args)` on a worker thread when the lane's turn comes; LaneFull if its backlog is full."""
        await self._enter(lane)
        try:
            return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)
        finally:
            self._leave(lane)

    async def _enter(self, lane: str) -> None:
        if lane not in self._waiting and self._can_start(lane):
            # Waiting lanes that could start have been started already: this one is not overtaking.
            self._start(lane)
            return
        queue = self._waiting.get(lane)
        if queue is None:
            queue = self._waiting[lane] = deque()
        if len(queue) >= self.backlog:
            if not queue:
                del self._waiting[lane]
            raise LaneFull(lane)
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        queue.append(turn)
        self._dispatch()
        try:
            await asyncio.wait_for(asyncio.shield(turn), self.max_wait_s)
        except (asyncio.CancelledError, TimeoutError) as exc:
            if turn.done() and not turn.cancelled():
                self._leave(lane)  # started in the same instant the caller left: give the thread back
            else:
                turn.cancel()
                self._forget(lane, turn)
            if isinstance(exc, TimeoutError):
                raise LaneFull(lane) from None
            raise

    def free(self, lane: str) -> bool:
        """Whether a job of `lane` would start now, waiting behind nothing."""
        return lane not in self._waiting and self._can_start(lane)

    def _can_start(self, lane: str) -> bool:
        return self._total < self.threads and self._running.get(lane, 0) < self.per_lane

    def _start(self, lane: str) -> None:
        self._total += 1
        self._running[lane] = self._running.get(lane, 0) + 1

    def _leave(self, lane: str) -> None:
        self._total -= 1
        left = self._running[lane] - 1
        if left:
            self._running[lane] = left
        else:
            del self._running[lane]
        self._dispatch()

    def _forget(self, lane: str, turn: asyncio.Future[None]) -> None:
        queue = self._waiting.get(lane)
        if queue is not None and turn in queue:
            queue.remove(turn)
            if not queue:
                del self._waiting[lane]

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
