"""Fair turns on the tokenizer threads: a flooding client waits behind itself, not in front of others."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from extproc.admission.capacity.lanes import LaneFull, Lanes


class Gate:
    """Jobs that block in their worker thread until released, recording the order they started in."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self.events: dict[str, threading.Event] = {}
        self.lock = threading.Lock()

    def job(self, name: str) -> str:
        with self.lock:
            self.started.append(name)
            event = self.events.setdefault(name, threading.Event())
        event.wait(5)
        return name

    def release(self, name: str) -> None:
        with self.lock:
            self.events.setdefault(name, threading.Event()).set()


async def until(check: object, limit_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + limit_s
    while not check():  # type: ignore[operator]
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.005)


async def test_a_newcomer_overtakes_a_flooding_lane() -> None:
    gate = Gate()
    with ThreadPoolExecutor(2) as pool:
        lanes = Lanes(pool, threads=2, per_lane=1, backlog=10, max_wait_s=10)
        flood = [asyncio.ensure_future(lanes.run("flood", gate.job, f"f{i}")) for i in range(6)]
        await until(lambda: gate.started == ["f0"])
        assert lanes.running == 1 and lanes.queued == 5  # one thread per lane: the other stays free
        other = asyncio.ensure_future(lanes.run("other", gate.job, "o0"))
        await until(lambda: "o0" in gate.started)  # started at once on the free thread
        gate.release("o0")
        assert await other == "o0"
        for i in range(6):
            gate.release(f"f{i}")
        assert await asyncio.gather(*flood) == [f"f{i}" for i in range(6)]
        assert lanes.running == 0 and lanes.queued == 0


async def test_free_threads_go_to_waiting_lanes_in_turn() -> None:
    gate = Gate()
    with ThreadPoolExecutor(1) as pool:
        lanes = Lanes(pool, threads=1, per_lane=1, backlog=10, max_wait_s=10)
        first = asyncio.ensure_future(lanes.run("a", gate.job, "a0"))
        await until(lambda: gate.started == ["a0"])
        jobs = [asyncio.ensure_future(lanes.run("a", gate.job, f"a{i}")) for i in (1, 2)]
        jobs += [asyncio.ensure_future(lanes.run("b", gate.job, "b0"))]
        await asyncio.sleep(0.01)
        for name in ("a0", "a1", "b0", "a2"):
            gate.release(name)
        await asyncio.gather(first, *jobs)
        assert gate.started == ["a0", "a1", "b0", "a2"]  # a, then b's turn before a's second waiter


async def test_a_full_backlog_refuses_at_once_and_a_cancelled_waiter_leaves_no_trace() -> None:
    gate = Gate()
    with ThreadPoolExecutor(1) as pool:
        lanes = Lanes(pool, threads=1, per_lane=1, backlog=1, max_wait_s=10)
        running = asyncio.ensure_future(lanes.run("a", gate.job, "a0"))
        await until(lambda: gate.started == ["a0"])
        waiting = asyncio.ensure_future(lanes.run("a", gate.job, "a1"))
        await asyncio.sleep(0.01)
        with pytest.raises(LaneFull):
            await lanes.run("a", gate.job, "a2")
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert lanes.queued == 0
        gate.release("a0")
        await running
        assert lanes.running == 0 and gate.started == ["a0"]


async def test_a_waiter_not_started_within_the_bound_is_refused() -> None:
    gate = Gate()
    with ThreadPoolExecutor(1) as pool:
        lanes = Lanes(pool, threads=1, per_lane=1, backlog=5, max_wait_s=0.05)
        running = asyncio.ensure_future(lanes.run("a", gate.job, "a0"))
        await until(lambda: gate.started == ["a0"])
        with pytest.raises(LaneFull):
            await lanes.run("b", gate.job, "b0")
        assert lanes.queued == 0
        gate.release("a0")
        await running
        assert lanes.running == 0 and gate.started == ["a0"]
