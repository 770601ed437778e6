"""Fair turns on the tokenizer threads: a flooding client waits behind itself, not in front of others."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest

from extproc.admission.capacity.lanes import FIRST_JOB_S, LaneFull, Lanes
from extproc.config.build import parse_config


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
        flood = [asyncio.ensure_future(lanes.run("flood", 1, gate.job, f"f{i}")) for i in range(6)]
        await until(lambda: gate.started == ["f0"])
        assert lanes.running == 1 and lanes.queued == 5  # one thread per lane: the other stays free
        other = asyncio.ensure_future(lanes.run("other", 1, gate.job, "o0"))
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
        first = asyncio.ensure_future(lanes.run("a", 1, gate.job, "a0"))
        await until(lambda: gate.started == ["a0"])
        jobs = [asyncio.ensure_future(lanes.run("a", 1, gate.job, f"a{i}")) for i in (1, 2)]
        jobs += [asyncio.ensure_future(lanes.run("b", 1, gate.job, "b0"))]
        await asyncio.sleep(0.01)
        for name in ("a0", "a1", "b0", "a2"):
            gate.release(name)
        await asyncio.gather(first, *jobs)
        assert gate.started == ["a0", "a1", "b0", "a2"]  # a, then b's turn before a's second waiter


async def test_a_full_backlog_refuses_at_once_and_a_cancelled_waiter_leaves_no_trace() -> None:
    gate = Gate()
    with ThreadPoolExecutor(1) as pool:
        lanes = Lanes(pool, threads=1, per_lane=1, backlog=1, max_wait_s=10)
        running = asyncio.ensure_future(lanes.run("a", 1, gate.job, "a0"))
        await until(lambda: gate.started == ["a0"])
        waiting = asyncio.ensure_future(lanes.run("a", 1, gate.job, "a1"))
        await asyncio.sleep(0.01)
        with pytest.raises(LaneFull):
            await lanes.run("a", 1, gate.job, "a2")
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
        running = asyncio.ensure_future(lanes.run("a", 1, gate.job, "a0"))
        await until(lambda: gate.started == ["a0"])
        with pytest.raises(LaneFull) as refused:
            await lanes.run("b", 1, gate.job, "b0")
        assert refused.value.retry_after_s == FIRST_JOB_S  # one job's time: nothing timed yet
        assert lanes.queued == 0
        gate.release("a0")
        await running
        assert lanes.running == 0 and gate.started == ["a0"]


class Timed(Gate):
    """Gated jobs that each take `seconds` of a clock of their own (the lanes' injected clock)."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds
        self.now = 0.0

    def clock(self) -> float:
        return self.now

    def job(self, name: str) -> str:
        done = super().job(name)
        self.now += self.seconds
        return done


def shipped(pool: ThreadPoolExecutor, clock: Callable[[], float]) -> Lanes:
    """Lanes as the shipped defaults configure them (`admission.tokenizer_*`, `max_body_bytes`)."""
    lanes = Lanes(pool, threads=2, clock=clock)
    lanes.configure(parse_config({}).admission_rules.tokenizing)
    return lanes


async def test_a_burst_of_one_clients_large_prompts_waits_its_turns_instead_of_being_refused() -> None:
    """Forty 12 KB prompts of one tenant at once (an SDK's `asyncio.gather`) take ~0.4 ms each to count:
    all of them wait their turn, with the shipped defaults. (The backlog of four refused thirty-five.)"""
    jobs = Timed(0.0004)
    with ThreadPoolExecutor(2) as pool:
        lanes = shipped(pool, jobs.clock)
        burst = [asyncio.ensure_future(lanes.run("tenant:t", 12_000, jobs.job, f"p{i}")) for i in range(40)]
        await until(lambda: jobs.started == ["p0"])
        assert lanes.queued == 39
        for i in range(40):
            jobs.release(f"p{i}")
        assert await asyncio.gather(*burst) == [f"p{i}" for i in range(40)]
        assert lanes.running == lanes.queued == 0


async def test_a_lane_whose_backlog_would_not_start_in_time_is_refused_at_once_with_when_it_drains() -> None:
    """At 0.2 s a job, the fourth waiter of a lane would start 0.7 s out, past the 0.5 s bound: refused at
    once, told to come back when the lane's backlog leaves a newcomer 0.5 s to wait (0.2 s)."""
    jobs = Timed(0.2)
    with ThreadPoolExecutor(1) as pool:
        lanes = Lanes(pool, threads=1, per_lane=1, max_wait_s=0.5, clock=jobs.clock)
        first = [asyncio.ensure_future(lanes.run("a", 1, jobs.job, f"a{i}")) for i in range(3)]
        await until(lambda: jobs.started == ["a0"])
        jobs.release("a0")  # its 0.2 s teach the lane; a1 runs, a2 waits
        await until(lambda: jobs.started == ["a0", "a1"])
        first += [asyncio.ensure_future(lanes.run("a", 1, jobs.job, "a3"))]  # 1.5 jobs ahead: 0.3 s
        first += [asyncio.ensure_future(lanes.run("a", 1, jobs.job, "a4"))]  # 2.5 jobs ahead: 0.5 s
        await until(lambda: lanes.queued == 3)
        with pytest.raises(LaneFull) as refused:
            await lanes.run("a", 1, jobs.job, "a5")  # 3.5 jobs ahead: 0.7 s
        assert refused.value.retry_after_s == pytest.approx(0.2)
        other = asyncio.ensure_future(lanes.run("b", 1, jobs.job, "b0"))  # another lane is not behind a's
        await asyncio.sleep(0.01)
        assert lanes.queued == 3 + 1
        for name in ("a1", "a2", "a3", "a4", "b0"):
            jobs.release(name)
        await asyncio.gather(*first, other)
        assert "a5" not in jobs.started and lanes.running == lanes.queued == 0


async def test_a_flood_of_large_bodies_holds_at_most_four_at_the_body_bound_waiting() -> None:
    """Megabyte bodies of one client that count fast would fit the wait by their job times: the lane holds
    at most four bodies at `admission.max_body_bytes` (1 MiB) waiting, as its backlog of four did, and
    refuses the fifth at once, while a burst of small prompts queues past four."""
    jobs = Timed(0.0004)
    with ThreadPoolExecutor(2) as pool:
        lanes = shipped(pool, jobs.clock)
        flood = [asyncio.ensure_future(lanes.run("client:m", 1 << 20, jobs.job, f"m{i}")) for i in range(5)]
        await until(lambda: jobs.started == ["m0"])
        assert lanes.queued == 4
        with pytest.raises(LaneFull):
            await lanes.run("client:m", 1 << 20, jobs.job, "m5")
        small = [asyncio.ensure_future(lanes.run("client:a", 12_000, jobs.job, f"a{i}")) for i in range(9)]
        await until(lambda: "a0" in jobs.started)
        assert lanes.queued == 4 + 8
        for name in [f"m{i}" for i in range(5)] + [f"a{i}" for i in range(9)]:
            jobs.release(name)
        await asyncio.gather(*flood, *small)
        assert lanes.running == lanes.queued == 0
