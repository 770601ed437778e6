"""Each pool's KV-budget figures exchanged with the other replicas through the shared store (`core.kv_fleet`).

A budget's figures go out after it changes (an admission, a release, a stream's progress, a feed sample),
at most once per `PUBLISH_EVERY_S` and one call in flight per pool: a burst of decisions is one call, and a
change made while a call is in flight is sent once it returns. The answer, the other replicas' figures, goes
to the budget at once; no answer (the store unreachable) leaves the last one, which the budget trusts for
`PEERS_FRESH_S` before it books on its fallback share. A budget that told a refused client when to come back
has the others' figures read again then (`Fleet.take_reads`): its room from their releases is there once read.

Once the store answered, a second call carries the pool's engine-tally figures (`EngineTally.figures`,
`KvBoard.exchange_runs`) and hands the others' to the tally: the charge of an answer not seen whole is its
share of the pool's growth against every replica's runs, which no replica sees alone. A pool without a KV
budget exchanges its runs alone, at each feed sample (`runs_changed`): with `kv_budget` off, each replica
would otherwise charge the pool's whole growth to its own runs. Either way a pool's runs go out at least every
`RUNS_EVERY_S` once they went out once: a replica whose pool admits nothing new publishes only at its feed's
samples, and on a saturated host those came over `REPLICA_TTL_S` apart: its figures expired from the store
while its requests still ran, and the other replica's count of a stream then took their steps for its own
(3,170 tokens for a stream that passed 607, in a fleet of two in front of the real engine).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import TypeVar

from extproc.core.engine.tally import EngineTally, no_tally
from extproc.core.kv.budget import KvBudget
from extproc.core.kv.fleet import PUBLISH_EVERY_S, Peers
from extproc.core.ports import KvBoard, StoreUnavailable

log = logging.getLogger(__name__)

RUNS_EVERY_S = 1.0
"""The longest a pool's runs go unpublished once they were (`FleetExchange`): well inside `REPLICA_TTL_S`
(5 s) and the tally's `PEER_STALE_S` (3 s), whatever the feed's interval."""

T = TypeVar("T")


class FleetExchange:
    """Publishes each pool's figures to a `KvBoard` and hands the others' back to the pool's budget."""

    def __init__(
        self,
        board: KvBoard,
        clock: Callable[[], float] = time.monotonic,
        on_peers: Callable[[str], None] = lambda _pool: None,
        tally_of: Callable[[str], EngineTally | None] = no_tally,
        replicas_at_least: Callable[[str], int] = lambda _key: 0,
    ) -> None:
        self._board = board
        self._tally_of = tally_of  # the pool's engine tally, whose runs go out with its budget's figures
        # The fewest other replicas a budget may count on (`_widened`): an engine's, its pool's.
        self._replicas_at_least = replicas_at_least
        self._clock = clock
        self._on_peers = on_peers  # told after a pool's budget took the others' figures (metrics, waiters)
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._later: dict[str, asyncio.TimerHandle] = {}
        self._reads: dict[str, dict[float, asyncio.TimerHandle]] = {}  # reads due (`_plan_reads`)
        self._dirty: set[str] = set()
        self._sent_at: dict[str, float] = {}
        self._runs_tasks: dict[str, asyncio.Task[None]] = {}  # runs-only exchanges (`runs_changed`)
        self._runs_later: dict[str, asyncio.TimerHandle] = {}  # the next runs-only one (`RUNS_EVERY_S`)
        self._closed = False
        self.exchanges = 0
        self.failures = 0

    def forget(self, pool: str) -> None:
        """`pool`'s budget is gone (an engine's, the feed forgot the engine): what was kept for its exchanges
        goes, unless one is under way or due; the reads planned for its refused clients go (`_plan_reads`)."""
        for handle in self._reads.pop(pool, {}).values():
            handle.cancel()
        if pool not in self._tasks and pool not in self._later:
            self._sent_at.pop(pool, None)
            self._dirty.discard(pool)

    def changed(self, pool: str, budget: KvBudget) -> None:
        """`budget` of `pool` changed: its figures go out now, or as soon as the interval allows; and the
        others' are read again at each moment a refused client was told to come back (`Fleet.take_reads`)."""
        self._plan_reads(pool, budget)
        if pool in self._tasks or pool in self._later:
            self._dirty.add(pool)
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # no loop (a synchronous caller): nothing to publish with
        wait = self._sent_at.get(pool, float("-inf")) + PUBLISH_EVERY_S - self._clock()
        if wait > 0:
            self._later[pool] = loop.call_later(wait, self._start, pool, budget)
        else:
            self._start(pool, budget)

    def _plan_reads(self, pool: str, budget: KvBudget) -> None:
        """An exchange at each moment `budget` told a refused client to come back, less a round trip: the
        room it counted on from the others' releases is there only once read (`Fleet.others_releases`)."""
        reads = budget.fleet.take_reads()
        if not reads or self._closed:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        pending = self._reads.setdefault(pool, {})
        for at in reads:
            if at not in pending:
                pending[at] = loop.call_later(max(0.0, at - self._clock()), self._read_due, pool, budget, at)

    def _read_due(self, pool: str, budget: KvBudget, at: float) -> None:
        self._reads.get(pool, {}).pop(at, None)
        self.changed(pool, budget)

    def _start(self, pool: str, budget: KvBudget) -> None:
        self._later.pop(pool, None)
        self._dirty.discard(pool)
        self._sent_at[pool] = self._clock()
        self._tasks[pool] = asyncio.get_running_loop().create_task(self._exchange(pool, budget))

    async def _exchange(self, pool: str, budget: KvBudget) -> None:
        share = budget.replica_share(self._clock())
        try:
            peers = await self._ask(pool, "kv fleet: exchange failed", self._board.exchange(pool, share))
            if peers is not None:
                self.exchanges += 1
                peers = self._widened(pool, peers)
            budget.observe_peers(peers, self._clock())
            if peers is not None and budget.fleet.must_publish:  # an ask, this one's or another's, waits
                self._dirty.add(pool)
            self._on_peers(pool)
            if peers is not None:  # the store answers: the runs go second, the budget waits on nothing
                await self._exchange_runs(pool)
        finally:
            self._tasks.pop(pool, None)
        if pool in self._dirty:
            self.changed(pool, budget)

    def _widened(self, key: str, peers: Peers) -> Peers:
        """`peers` counting at least `replicas_at_least(key)` other replicas. An engine's budget is made at
        the first request a picker sends there, so a replica that has sent none publishes nothing under the
        engine's key, and the others read it as absent and took all of the engine's room between them: two
        gateways each admitted what the engine held, and it preempted. Counted, it is a live replica with
        nothing booked there, and the room is divided (`Fleet.budget`)."""
        least = self._replicas_at_least(key)
        return peers if peers.replicas >= least else replace(peers, replicas=least)

    def runs_changed(self, pool: str) -> None:
        """A feed sample of a pool without a KV budget: its runs go out alone (one call in flight per pool,
        at the feed's pace), so the charge tally still splits the pool's growth against every replica's."""
        if pool in self._runs_tasks:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        task = loop.create_task(self._exchange_runs(pool))
        self._runs_tasks[pool] = task
        task.add_done_callback(lambda _done: self._runs_tasks.pop(pool, None))

    async def _exchange_runs(self, pool: str) -> None:
        """The pool's tally's runs out, the other replicas' in (none without a tally: no feed yet); a store
        that does not answer leaves the tally its last reading, which it carries a while (`PEER_STALE_S`)."""
        tally = self._tally_of(pool)
        if tally is None:
            return
        runs = self._board.exchange_runs(pool, tally.figures(self._clock()))
        replicas = await self._ask(pool, "kv fleet: runs exchange failed", runs)
        if replicas is not None:
            tally.observe_peers(replicas, self._clock())
        later = self._runs_later.pop(pool, None)
        if later is not None:
            later.cancel()
        if not self._closed:
            self._runs_later[pool] = asyncio.get_running_loop().call_later(RUNS_EVERY_S, self._runs_due, pool)

    def _runs_due(self, pool: str) -> None:
        """`RUNS_EVERY_S` without a runs exchange of `pool`: one now."""
        self._runs_later.pop(pool, None)
        self.runs_changed(pool)

    async def _ask(self, pool: str, failed: str, call: Awaitable[T]) -> T | None:
        """One call to the board, None where it gives no answer: a store that does not answer, or a bug
        (logged as `failed`), counts as a failure and must not stop publishing (the budget falls back to its
        share, the tally keeps its last reading)."""
        try:
            return await call
        except StoreUnavailable:
            self.failures += 1
        except Exception:
            self.failures += 1
            log.exception(failed, extra={"pool": pool})
        return None

    async def close(self) -> None:
        """Stop publishing: pending publications dropped, calls in flight cancelled (the figures expire in
        the store `REPLICA_TTL_S` after the last one)."""
        self._closed = True
        reads = [handle for pending in self._reads.values() for handle in pending.values()]
        for handle in [*self._later.values(), *self._runs_later.values(), *reads]:
            handle.cancel()
        self._later.clear()
        self._reads.clear()
        self._runs_later.clear()
        tasks = [*self._tasks.values(), *self._runs_tasks.values()]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()
        self._runs_tasks.clear()
