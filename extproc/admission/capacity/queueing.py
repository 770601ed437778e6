"""A bounded wait for capacity instead of an instant 429, for classes configured to queue.

A request that does not fit waits, up to the smallest of its bounds (the global one, its class's, its own
deadline), in the `WaitQueue` (highest class first, tenants taking turns within a class, per tenant nearest
deadline first, then arrival order). Whenever capacity may have freed — a lease settled,
limits or scales changed — and every 100 ms while anyone waits (token buckets refill with time), the queue
is pumped: each class's waiting heads try to acquire, in order, and those that fit are admitted. With a
shared store, a release on another replica also pumps the queue at once: while anyone waits here the store is
told (`announce_waiting`), releases everywhere then publish a wake-up, and the store calls `kick`. The 100 ms
tick stays as the fallback when wake-ups are lost.

A newcomer never overtakes waiters of its own or a higher class: while they wait, it queues behind them.
A request with a deadline of its own (extproc/admission/intake/deadline.py) goes ahead of its own tenant's
requests with later or no deadlines (`Waiter.due`). The pump keeps the last refusal each class's heads met
(`blocked`), so a newcomer that lines up behind them without trying can still be told at once that its
deadline is out of reach. Letting it wait is a promise (`deadline_refusal`): made only where the layout of
the line expects its capacity a margin before its deadline (its first token's delay and the slip the
forecast has shown, `ForecastSlip`, which each grant teaches), and kept: a waiter is not refused because
the layout later says it is late, only once a grant could no longer bring its first token in time. A waiter
whose client leaves (Envoy cancels the stream) leaves the queue at once; a lease granted at the very moment
it left is given straight back, so nothing leaks. A newcomer whose turn behind its own tenant's line would
not come within its wait even at twice the pace the class has lately drained at (`DrainPace`: a waiter whose
wait ends first leaves without a grant) is refused at once, `QueueFull` with when its turn is expected.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from extproc.core.clock import Clock
from extproc.core.limiter.limiter import TOKEN_REASONS, Lease, Reason, Rejection
from extproc.core.ports import LimiterStore
from extproc.core.queue.drain import DrainPace
from extproc.core.queue.slip import ForecastSlip
from extproc.core.queue.waitqueue import Waiter, WaitQueue
from extproc.metrics import Metrics

log = logging.getLogger(__name__)

PUMP_INTERVAL_S = 0.1
FIRST_TOKEN_S = 0.05
"""How long after its capacity is granted a request's first token is expected at its client (the request
resumes, the engine takes its first step, the token streams back): a wait that ends later than this
before its deadline cannot meet it, and a promise must leave it."""
WAITABLE = (Reason.CONCURRENCY, *TOKEN_REASONS)
"""Refusals that time can cure; a request larger than the bucket's base capacity never waits."""


class Gate(Protocol):
    """What a waiter needs besides the store's slots and tokens (its KV, `booking.KvGate`): the pump asks
    before it acquires, so a request the KV budget refused waits in its class's queue like one a slot
    refused, instead of being sent away when a short wait would do."""

    def open(self) -> bool:
        """Take what the waiter needs if it is there now (True); else take nothing."""
        ...

    def close(self) -> None:
        """Give back what `open` took: the store refused the waiter after all."""
        ...


class QueueFull(Exception):
    """The class's queue is at its bound (or the class does not queue), or the newcomer's turn would not come
    within its wait (`DrainPace`): then `eta`, the seconds until its turn is expected."""

    def __init__(self, eta: float | None = None) -> None:
        super().__init__("queue full" if eta is None else f"turn expected in {eta:.3f} s")
        self.eta = eta


class DeadlineUnmet(Exception):
    """A waiter's own deadline is out of reach: its capacity is not expected before it (`eta` seconds, where
    known; None once a grant could no longer bring its first token in time)."""

    def __init__(self, eta: float | None) -> None:
        super().__init__("deadline passed" if eta is None else f"capacity expected in {eta:.3f} s")
        self.eta = eta


Schedule = Callable[[Rejection, Sequence[float], Sequence[float]], list[float] | None]
"""When each of a line of requests refused so is expected to have its capacity, each holding it for its
run in seconds, beside slots held that many seconds by leases granted here and not open yet
(`AdmissionService.capacity_starts`); None where nothing tells."""


def _no_schedule(_rejection: Rejection, _runs: Sequence[float], _held: Sequence[float]) -> list[float] | None:
    return None


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
        self._blocked: dict[str, Rejection] = {}
        # Waiters the pump granted a lease whose requests have not resumed: their leases hold slots that
        # no open request shows yet, which the deadlines' layout counts (`_schedule`).
        self._granted: set[Waiter] = set()
        # When each waiter was first expected to have its capacity (noted by a pump, moved later by each
        # newcomer placed ahead of it) and when that was noted: how late capacity came against such
        # forecasts is the margin newcomers' promises keep (`ForecastSlip`).
        self._forecast: dict[Waiter, tuple[float, float]] = {}
        self.slip = ForecastSlip()
        self._drains: dict[str, DrainPace] = {}  # per class: how fast its line has lately drained
        # Wired by the admission service (compose.py): when refused waiters' capacity is expected.
        self.starts: Schedule = _no_schedule

    def configure(self, priority: Sequence[str], max_queued: dict[str, int]) -> None:
        self.queue.configure(priority, max_queued)
        self.kick()

    def must_queue(self, holder: str) -> bool:
        """True when waiters of this class or a higher one exist: a newcomer must line up behind them."""
        return self.queue.ahead_of(holder)

    def blocked(self, holder: str) -> Rejection | None:
        """The refusal the last pump met for a waiter of this class (None when none is waiting)."""
        return self._blocked.get(holder) if self.queue.depth(holder) else None

    def deadline_refusal(
        self, holder: str, tenant: str, keys: Sequence[str], due: float, run_s: float, refused: Rejection
    ) -> float | None:
        """Whether a newcomer due at `due` (this queue's clock) that will hold its capacity `run_s` seconds
        may wait, its capacity refused as `refused`: None when it may, else the seconds until its capacity
        is expected (its retry-after). Waiting is a promise, kept to the end (`wait`), so it is made with a
        margin: the newcomer may wait when its capacity is expected a margin before its deadline, and its
        place, ahead of requests with later deadlines, pushes none of those still in time later into that
        margin. The margin: its first token's delay after the grant (`FIRST_TOKEN_S`) and how late capacity
        has come against this forecast lately (`ForecastSlip`). None where nothing tells (`Schedule`)."""
        now = self.clock()
        newcomer = Waiter(holder, tenant, now, due, (tuple(keys), 0, None), sys.maxsize, due, run_s)
        after = self._schedule(holder, refused, newcomer)
        if after is None:
            return None
        mine = after.pop(newcomer)
        if now + mine + self._margin(mine) > due:
            return mine
        before = self._schedule(holder, refused) or {}
        for waiter, start in after.items():
            was = before[waiter]
            if waiter.due is None or start <= was or now + was + FIRST_TOKEN_S > waiter.due:
                continue  # not moved, or already out of time: the newcomer costs it nothing
            if now + start + self._margin(start) > waiter.due:
                return mine
        for waiter, start in after.items():  # moved by the newcomer, not by the forecast slipping
            noted = self._forecast.get(waiter)
            if noted is not None and start > before[waiter]:
                self._forecast[waiter] = (noted[0], noted[1] + start - before[waiter])
        return None

    def _margin(self, start: float) -> float:
        """How far before its deadline a start `start` seconds away must be expected to be promised: the
        first token's delay after it and the slip the forecast has shown over such a horizon."""
        return FIRST_TOKEN_S + self.slip.margin(start)

    def _schedule(
        self, holder: str, refused: Rejection, extra: Waiter | None = None
    ) -> dict[Waiter, float] | None:
        """When each waiter of this class and those above that needs the refused key is expected to have
        it, in the order they are expected to be admitted (`WaitQueue.service_order`)."""
        line = [w for w in self.queue.service_order(holder, extra) if refused.key in w.payload[0]]
        held = [w.run_s for w in self._granted if refused.key in w.payload[0]]
        starts = self.starts(refused, [w.run_s for w in line], held)
        return None if starts is None else dict(zip(line, starts, strict=True))

    async def wait(
        self,
        keys: Sequence[str],
        tokens: int,
        holder: str,
        tenant: str,
        max_wait_s: float,
        due: float | None = None,
        refused: Rejection | None = None,
        run_s: float = 0.0,
        gate: Gate | None = None,
        output_tokens: int = 0,
    ) -> Lease | Rejection | None:
        """Wait for a lease. None when the wait's end passed (`max_wait_s`, already the smallest of the
        bounds that apply); QueueFull when there is no room to wait; DeadlineUnmet when `due`, the request's
        own deadline on this queue's clock (which also orders its tenant's line), can no longer be met: a
        grant now would bring its first token after it (`FIRST_TOKEN_S`). Nothing else ends a wait with a
        deadline early: the layout said it was in time when it began (`deadline_refusal`), and a forecast
        that slipped since may slip back. `refused`: what the request met trying at once, the class's
        `blocked` until a pump runs; `run_s`: how long it will hold its capacity, for the deadlines of the
        waiters behind it; `gate`: what else it needs, opened before each try (a lease granted finds it
        open); `output_tokens`: how many of `tokens` are reserved completion (split input and output
        limits)."""
        if refused is not None:
            self._blocked[holder] = refused
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Lease] = loop.create_future()
        now = self.clock()
        end, by_due = _wait_end(now + max_wait_s, due)
        waiter = Waiter(holder, tenant, enqueued_at=now, deadline=end, due=due, run_s=run_s)
        waiter.payload = (tuple(keys), tokens, future, gate, output_tokens)
        ahead = self.queue.ahead_in_line(holder, tenant, due)
        eta = self._drain(holder).out_of_reach(now, ahead, end)
        if eta is not None or not self.queue.push(waiter):
            self.metrics.queue_wait_seconds.labels(holder, "full").observe(0)
            raise QueueFull(eta)
        self._depth(holder)
        self.kick()
        outcome = "deadline" if by_due else "timeout"
        try:
            lease = await asyncio.wait_for(asyncio.shield(future), max(0.0, end - now))
            outcome = "admitted"
            return lease
        except _Unwaitable as exc:
            outcome = "refused"
            return exc.rejection
        except _Expired:
            _end_of(by_due)  # the pump found its end passed on the injected clock
            return None
        except TimeoutError:
            if future.done() and not future.cancelled() and future.exception() is None:
                outcome = "admitted"
                return future.result()  # admitted in the same instant the deadline passed
            future.cancel()  # an acquire still in flight for this waiter gives its lease back
            _end_of(by_due)
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
            self._granted.discard(waiter)
            self._forecast.pop(waiter, None)
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
        checked: set[str] = set()  # classes whose deadlines this pass compared with what their heads met
        try:
            self._expire()
            for waiter in list(self.queue.candidates()):
                keys, tokens, future, gate, output_tokens = waiter.payload
                if future.done() or (gate is not None and not gate.open()):
                    continue  # a gate still shut (its KV does not fit): the next pump asks again
                result = await self.store.acquire(keys, tokens, waiter.holder, output_tokens=output_tokens)
                if gate is not None and not isinstance(result, Lease):
                    gate.close()
                if isinstance(result, Lease):
                    if future.done():  # its client left while we acquired
                        self._give_back(result)
                        continue
                    self.queue.remove(waiter)
                    self._depth(waiter.holder)
                    future.set_result(result)
                    self._granted.add(waiter)
                    self._drain(waiter.holder).granted(self.clock())
                    noted = self._forecast.pop(waiter, None)
                    if noted is not None:
                        self.slip.observe(*noted, self.clock())
                    admitted = True
                elif result.reason in WAITABLE:
                    self._blocked[waiter.holder] = result
                    if waiter.holder not in checked:
                        checked.add(waiter.holder)
                        self._foresee(waiter.holder, result)
                elif not future.done():
                    future.set_exception(_Unwaitable(result))
        except Exception:
            log.exception("admission queue pump failed")
        finally:
            self._pumping = False
        if admitted:
            self.kick()
        self._rearm()

    def _expire(self) -> None:
        """End the waits whose end has passed on the queue's clock. The event loop's timer ends them too
        (`wait`); this pass makes the end follow the injected clock, so a test moves it without sleeping."""
        for waiter in self.queue.expired(self.clock()):
            future = waiter.payload[2]
            if not future.done():
                future.set_exception(_Expired())

    def _foresee(self, holder: str, rejection: Rejection) -> None:
        """Note when each waiter in line for the capacity `rejection` refused is expected to have it, the
        first time a pump lays it out: its grant then tells how far the forecast slipped over that
        horizon (`ForecastSlip`). A newcomer placed ahead moves the note with it (`deadline_refusal`);
        other reorderings (a higher class, a tenant's turn) count as slip, the cautious side."""
        schedule = self._schedule(holder, rejection)
        now = self.clock()
        for waiter, start in (schedule or {}).items():
            self._forecast.setdefault(waiter, (now, now + start))

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
        depth = self.queue.depth(holder)
        self.metrics.queue_depth.labels(holder).set(depth)
        self._drain(holder).depth(self.clock(), depth)

    def _drain(self, holder: str) -> DrainPace:
        """The class's drain pace (one per class configured to queue: a bounded set)."""
        return self._drains.setdefault(holder, DrainPace())

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()


def _wait_end(bound: float, due: float | None) -> tuple[float, bool]:
    """When a wait ends, its other bounds ending at `bound`, and whether its own deadline `due` sets it:
    the last moment a grant still brings its first token in time (`FIRST_TOKEN_S` before it)."""
    if due is not None and due - FIRST_TOKEN_S < bound:
        return due - FIRST_TOKEN_S, True
    return bound, False


def _end_of(by_due: bool) -> None:
    """A wait's end passed: DeadlineUnmet where the request's own deadline set it (else it timed out)."""
    if by_due:
        raise DeadlineUnmet(None)


class _Unwaitable(Exception):
    """Raised into a waiter whose request can never fit (for example larger than the bucket)."""

    def __init__(self, rejection: Rejection) -> None:
        super().__init__(rejection.reason.value)
        self.rejection = rejection


class _Expired(Exception):
    """Raised into a waiter whose wait ended by the queue's clock before the event loop's timer fired."""
