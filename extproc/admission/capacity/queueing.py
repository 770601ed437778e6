"""A bounded wait for capacity instead of an instant 429, for classes configured to queue.

A request that does not fit waits, up to its class's deadline, in the `WaitQueue` (highest class first,
tenants taking turns within a class, FIFO per tenant). Whenever capacity may have freed — a lease settled,
limits or scales changed — and every 100 ms while anyone waits (token buckets refill with time), the queue
is pumped: each class's waiting heads try to acquire, in order, and those that fit are admitted. With a
shared store, a release on another replica also pumps the queue at once: while anyone waits here the store is
told (`announce_waiting`), releases everywhere then publish a wake-up, and the store calls `kick`. The 100 ms
tick stays as the fallback when wake-ups are lost.

A newcomer never overtakes waiters of its own or a higher class: while they wait, it queues behind them.
A waiter whose client leaves (Envoy cancels the stream) leaves the queue at once; a lease granted at the
very moment it left is given straight back, so nothing leaks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from typing import Any

from extproc.core.clock import Clock
from extproc.core.limiter import TOKEN_REASONS, Lease, Reason, Rejection
from extproc.core.ports import LimiterStore
from extproc.core.waitqueue import Waiter, WaitQueue
from extproc.metrics import Metrics

log = logging.getLogger(__name__)

PUMP_INTERVAL_S = 0.1
WAITABLE = (Reason.CONCURRENCY, *TOKEN_REASONS)
"""Refusals that time can cure; a request larger than the bucket's base capacity never waits."""


class QueueFull(Exception):
    """The class's queue is at its bound (or the class does not queue)."""


class AdmissionQueue:
    def __init__(self, store: LimiterStore, clock: Clock, metrics: Metrics) -> None:
        self.store = store
        self.clock = clock
        self.metrics = metrics
        self.queue = WaitQueue((), {})
        self._scheduled = False
        self._pumping = False
        self._timer: asyncio.TimerHandle | None = None
        self._background: set[asyncio.Future[Any]] = set()

    def configure(self, priority: Sequence[str], max_queued: dict[str, int]) -> None:
        self.queue.configure(priority, max_queued)
        self.kick()

    def must_queue(self, holder: str) -> bool:
        """True when waiters of this class or a higher one exist: a newcomer must line up behind them."""
        return self.queue.ahead_of(holder)

    async def wait(
        self,
        keys: Sequence[str],
        tokens: int,
        holder: str,
        tenant: str,
        max_wait_s: float,
        output_tokens: int = 0,
    ) -> Lease | Rejection | None:
        """Wait for a lease (`output_tokens` of `tokens` reserved completion). None when the deadline passed;
        QueueFull when there is no room to wait."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Lease] = loop.create_future()
        now = self.clock()
        waiter = Waiter(holder=holder, tenant=tenant, enqueued_at=now, deadline=now + max_wait_s)
        waiter.payload = (tuple(keys), tokens, output_tokens, future)
        if not self.queue.push(waiter):
            self.metrics.queue_wait_seconds.labels(holder, "full").observe(0)
            raise QueueFull
        self._depth(holder)
        self.kick()
        outcome = "timeout"
        try:
            lease = await asyncio.wait_for(asyncio.shield(future), max_wait_s)
            outcome = "admitted"
            return lease
        except _Unwaitable as exc:
            outcome = "refused"
            return exc.rejection
        except TimeoutError:
            if future.done() and not future.cancelled():
                outcome = "admitted"
                return future.result()  # admitted in the same instant the deadline passed
            future.cancel()  # an acquire still in flight for this waiter gives its lease back
            return None
        except asyncio.CancelledError:
            outcome = "cancelled"
            if future.done() and not future.cancelled():
                self._give_back(future.result())
            else:
                future.cancel()
            raise
        finally:
            self.queue.remove(waiter)
            self._depth(holder)
            self.metrics.queue_wait_seconds.labels(holder, outcome).observe(self.clock() - now)

    def kick(self) -> None:
        """Capacity may have freed: pump soon (coalesced, on the event loop)."""
        if self._scheduled or not len(self.queue):
            return
        with contextlib.suppress(RuntimeError):  # no running loop: nothing can be waiting
            asyncio.get_running_loop().call_soon(self._start_pump)
            self._scheduled = True

    def _start_pump(self) -> None:
        self._scheduled = False
        if self._pumping:
            return
        task = asyncio.ensure_future(self._pump())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _pump(self) -> None:
        self._pumping = True
        admitted = False
        try:
            for waiter in list(self.queue.candidates()):
                keys, tokens, output_tokens, future = waiter.payload
                if future.done():
                    continue
                result = await self.store.acquire(keys, tokens, waiter.holder, output_tokens=output_tokens)
                if isinstance(result, Lease):
                    if future.done():  # its client left while we acquired
                        self._give_back(result)
                        continue
                    self.queue.remove(waiter)
                    self._depth(waiter.holder)
                    future.set_result(result)
                    admitted = True
                elif result.reason not in WAITABLE and not future.done():
                    future.set_exception(_Unwaitable(result))
        except Exception:
            log.exception("admission queue pump failed")
        finally:
            self._pumping = False
        if admitted:
            self.kick()
        self._rearm()

    def _rearm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if len(self.queue):
            self._timer = asyncio.get_running_loop().call_later(PUMP_INTERVAL_S, self.kick)
            self.store.announce_waiting()  # a shared store asks other replicas to signal their releases

    def _give_back(self, lease: Lease) -> None:
        task = asyncio.ensure_future(self.store.release(lease, 0))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _depth(self, holder: str) -> None:
        self.metrics.queue_depth.labels(holder).set(self.queue.depth(holder))

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()


class _Unwaitable(Exception):
    """Raised into a waiter whose request can never fit (for example larger than the bucket)."""

    def __init__(self, rejection: Rejection) -> None:
        super().__init__(rejection.reason.value)
        self.rejection = rejection
