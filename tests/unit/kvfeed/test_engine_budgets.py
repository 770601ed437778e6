"""One KV budget per engine where a picker names the engine: fed that engine's readings alone, made only
for engines the feed reads, and dropped with its series once the feed forgets the engine and nothing holds
it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from prometheus_client import CollectorRegistry

from extproc.config import parse_config
from extproc.core.clock import FakeClock
from extproc.core.kv.fleet import Peers
from extproc.kvfeed.engines import ServerKind
from extproc.kvfeed.sample import FeedSample
from extproc.kvfeed.subscriber.loop import FeedbackLoop
from extproc.kvfeed.subscriber.runtime import FeedbackRuntime


def sample(endpoint: str, kv: float, cap: int = 1000, t: float = 1.0, running: float = 0.0) -> FeedSample:
    return FeedSample("node", endpoint, "m", ServerKind.VLLM, kv, 0.0, running, 0.0, cap, t, True)


FEED = {"direct_targets": [{"url": "http://127.0.0.1:1/metrics", "kind": "vllm", "model": "m"}]}
BUDGETS = {"enabled": True, "target_utilization": 0.9, "fair_shares": False}


@contextlib.asynccontextmanager
async def engine_runtime(
    clock: FakeClock, registry: CollectorRegistry | None = None, board: object = None
) -> AsyncIterator[tuple[FeedbackRuntime, FeedbackLoop]]:
    """A started runtime whose budgets book 0.9 of their cache, fair shares off (sharing through `board`,
    if given), and its loop; stopped on exit."""
    runtime = FeedbackRuntime(registry or CollectorRegistry(), lambda key, scale: None, clock)
    if board is not None:
        runtime.share_through(board, 0.5)  # type: ignore[arg-type]
    await runtime.apply(parse_config({"feedback": FEED, "kv_budget": BUDGETS}).feedback, ["m"])
    try:
        assert runtime.loop is not None
        yield runtime, runtime.loop
    finally:
        await runtime.stop()


async def test_an_engine_budget_reads_its_engine_alone() -> None:
    """Engines at 0.8 and 0.1 of 1,000 tokens each: the pool's budget reads the pool as full as its fullest
    (1,600 of 2,000), the emptier engine's reads 100 of 1,000, so 800 more fit there (900 less 100), while
    the pool's budget has 200 left (1,800 less 1,600)."""

    clock = FakeClock(100.0)
    async with engine_runtime(clock) as (runtime, loop):
        loop.subscriber.ingest(sample("10.0.0.1:8000", 0.8))
        loop.subscriber.ingest(sample("10.0.0.2:8000", 0.1))
        pool = runtime.budget("m")
        assert pool is not None and pool.capacity_tokens == 2000
        found = runtime.endpoint_budget("m", "10.0.0.2:8000")
        assert found is not None
        key, engine = found
        assert key == "m@10.0.0.2:8000" and engine is not pool
        assert engine.capacity_tokens == 1000
        # (Each holds a request first: a budget with nothing admitted admits anything, `would_fit`.)
        pool.admit("p", 90, 10, now=clock.now)
        assert pool.would_fit(90, 10, now=clock.now) == (True, 100)
        assert not pool.would_fit(700, 100, now=clock.now)[0]
        loop.subscriber.ingest(sample("10.0.0.2:8000", 0.1, t=2.0))  # its budget reads it
        assert engine.unexplained_tokens == 100
        engine.admit("e", 90, 10, now=clock.now)
        assert engine.would_fit(600, 100, now=clock.now) == (True, 700)
        assert not engine.would_fit(700, 101, now=clock.now)[0]
        # The other engine's samples move the pool's budget, never this one's.
        loop.subscriber.ingest(sample("10.0.0.1:8000", 0.3, t=2.0))
        assert engine.unexplained_tokens == 100


async def test_only_engines_the_feed_reads_get_a_budget() -> None:
    clock = FakeClock(100.0)
    async with engine_runtime(clock) as (runtime, loop):
        loop.subscriber.ingest(sample("10.0.0.1:8000", 0.2))
        assert runtime.endpoint_budget("m", "10.9.9.9:8000") is None  # not in the feed: the pool's
        assert runtime.endpoint_budget("other", "10.0.0.1:8000") is None  # a pool without a budget
        assert runtime.endpoint_budget("m", "10.0.0.1:8000") is not None
        clock.now += 60.0  # its samples stale: the pool's budget books again
        assert runtime.endpoint_budget("m", "10.0.0.1:8000") is None


async def test_an_engine_the_feed_forgot_loses_its_budget_and_series_once_nothing_holds_it() -> None:
    clock = FakeClock(100.0)
    registry = CollectorRegistry()
    async with engine_runtime(clock, registry) as (runtime, loop):
        loop.subscriber.ingest(sample("10.0.0.1:8000", 0.2))
        loop.subscriber.ingest(sample("10.0.0.2:8000", 0.2))
        found = runtime.endpoint_budget("m", "10.0.0.1:8000")
        assert found is not None
        key, engine = found
        engine.admit("r", 100, 10, now=clock.now)
        runtime.budget_changed(key)
        labels = {"pool": key}
        assert registry.get_sample_value("extproc_kv_demand_tokens", labels) == 110

        clock.now += loop.subscriber.config.forget_after + 1
        loop.subscriber.ingest(sample("10.0.0.2:8000", 0.2, t=9e3))  # only this one still publishes
        loop.tick()  # the subscriber forgets the silent engine, and the loop with it
        loop.subscriber.ingest(sample("10.0.0.2:8000", 0.2, t=9e3 + 1))
        assert runtime.endpoint_budget("m", "10.0.0.1:8000") is None
        assert registry.get_sample_value("extproc_kv_demand_tokens", labels) == 110  # still held

        engine.release("r")
        runtime.budget_changed(key)  # as the request's booking tells it
        assert registry.get_sample_value("extproc_kv_demand_tokens", labels) is None
        assert runtime.budget("m") is not None  # the pool's own budget stays


def counted(endpoint: str, generated: float, running: float, t: float) -> FeedSample:
    """A sample with the engine's generation counter and running count (what a tally reads)."""
    return FeedSample(
        "node", endpoint, "m", ServerKind.VLLM, 0.1, 0.0, running, 0.0, 1000, t, True,
        generation_tokens_total=generated,
    )  # fmt: skip


async def test_a_request_booked_on_an_engine_is_counted_from_that_engine_alone() -> None:
    """Engine a generates 100 tokens over two seconds for one running request, engine b 900 for three of
    its own: the pool's tally splits 1,000 over four runs, engine a's gives its one request a's 100. Its
    tally, made at the first ask, starts from a's newest sample, so a request admitted then is counted."""

    clock = FakeClock(100.0)
    async with engine_runtime(clock) as (runtime, loop):
        for endpoint, generated in (("10.0.0.1:8000", 500.0), ("10.0.0.2:8000", 2000.0)):
            loop.subscriber.ingest(counted(endpoint, generated, 0.0, 1.0))
        found = runtime.endpoint_budget("m", "10.0.0.1:8000")
        assert found is not None
        key = found[0]
        tally = runtime.engine_tally(key)
        assert tally is not None and tally is not runtime.engine_tally("m")
        start = clock.now
        tally.begin("r", start, 1)
        clock.now += 2.0
        loop.subscriber.ingest(counted("10.0.0.1:8000", 600.0, 1.0, 2.0))
        loop.subscriber.ingest(counted("10.0.0.2:8000", 2900.0, 3.0, 2.0))
        assert tally.count(start, clock.now, 1, key="r") == 100
        assert runtime.engine_tally(key) is tally  # one per engine, kept


class Board:
    """A `KvBoard` recording what each key published; `others` other live replicas of the pool, which have
    published nothing under any engine's key."""

    def __init__(self, others: int = 0) -> None:
        self.kv: list[str] = []
        self.runs: list[str] = []
        self.others = others

    async def exchange(self, pool: str, share: object) -> Peers:
        self.kv.append(pool)
        return Peers(replicas=0 if "@" in pool else self.others, now_ms=len(self.kv), oldest_ms=-1)

    async def exchange_runs(self, pool: str, figures: object) -> dict[str, object]:
        self.runs.append(pool)
        return {}


async def test_replicas_sharing_a_store_exchange_an_engine_budget_under_its_key() -> None:
    """Another replica's requests picked to the same engine are in that engine's figures: each replica's
    engine budget goes out under the engine's key, with its engine tally's runs."""

    clock = FakeClock(100.0)
    board = Board()
    async with engine_runtime(clock, board=board) as (runtime, loop):
        loop.subscriber.ingest(counted("10.0.0.1:8000", 100.0, 0.0, 1.0))
        found = runtime.endpoint_budget("m", "10.0.0.1:8000")
        assert found is not None
        key, engine = found
        assert engine.fleet.shared  # it divides the engine with the other replicas, as a pool's does
        engine.admit("r", 100, 10, now=clock.now)
        runtime.budget_changed(key)
        for _ in range(20):
            await asyncio.sleep(0)
        assert key in board.kv and key in board.runs


async def test_an_engine_budget_counts_on_its_pools_replicas_before_they_publish_under_its_key() -> None:
    """Two gateways; neither has sent a request to the engine yet, so the store holds no figures under its
    key. The first request's budget must still count on the other gateway, which may send one there at any
    moment: before its first exchange it takes its sliver, not its fallback share (the whole engine by
    default: two gateways each admitted what the engine held, and it preempted), and after it half of the
    engine's free room, not all of it."""

    clock = FakeClock(100.0)
    async with engine_runtime(clock, board=Board(others=1)) as (runtime, loop):
        loop.subscriber.ingest(sample("10.0.0.1:8000", 0.0))
        pool = runtime.budget("m")
        assert pool is not None
        runtime.budget_changed("m")  # the pool's exchange: one other live gateway
        for _ in range(20):
            await asyncio.sleep(0)
        assert (peers := pool.fleet.peers(clock.now)) is not None and peers.replicas == 1
        found = runtime.endpoint_budget("m", "10.0.0.1:8000")
        assert found is not None
        key, engine = found
        assert engine.budget_tokens is not None and engine.budget_tokens < 100  # its sliver of 900
        engine.admit("r", 100, 10, now=clock.now)
        runtime.budget_changed(key)  # its first exchange: nobody under its key, the pool's other counted
        for _ in range(20):
            await asyncio.sleep(0)
        assert engine.budget_tokens == 110 + (900 - 110) // 2


async def test_an_engine_without_a_capacity_reading_books_the_pool() -> None:
    """A budget of unknown capacity admits anything: until the engine publishes its capacity, the pool's
    budget books what the picker sends it."""

    clock = FakeClock(100.0)
    async with engine_runtime(clock) as (runtime, loop):
        loop.subscriber.ingest(sample("10.0.0.1:8000", 0.2))
        blind = FeedSample("node", "10.0.0.2:8000", "m", ServerKind.VLLM, 0.2, 0.0, 0.0, 0.0, None, 1.0, True)
        loop.subscriber.ingest(blind)
        assert runtime.endpoint_budget("m", "10.0.0.2:8000") is None
        assert runtime.endpoint_budget("m", "10.0.0.1:8000") is not None


async def test_a_restarted_feed_keeps_the_engines_budgets() -> None:
    """A reload that restarts the feed starts with no reading of any engine: their budgets stay (with what
    they learned) until the new loop forgets an engine."""

    clock = FakeClock(100.0)
    async with engine_runtime(clock) as (runtime, loop):
        loop.subscriber.ingest(sample("10.0.0.1:8000", 0.2))
        found = runtime.endpoint_budget("m", "10.0.0.1:8000")
        assert found is not None
        budget_config = {"enabled": True, "target_utilization": 0.8, "fair_shares": False}
        await runtime.apply(parse_config({"feedback": FEED, "kv_budget": budget_config}).feedback, ["m"])
        restarted = runtime.loop
        assert restarted is not None and restarted is not loop
        restarted.subscriber.ingest(sample("10.0.0.2:8000", 0.2))  # the pool sampled, not engine 1
        restarted.tick()
        restarted.subscriber.ingest(sample("10.0.0.1:8000", 0.2, t=2.0))
        again = runtime.endpoint_budget("m", "10.0.0.1:8000")
        assert again is not None and again[1] is found[1]


async def test_a_dropped_budget_a_waiting_request_still_holds_comes_back_with_its_engine() -> None:
    """A request resolved to an engine's budget may wait in a queue while the feed forgets the engine and
    the budget goes; what it books there is in the budget the engine's next request gets."""

    clock = FakeClock(100.0)
    async with engine_runtime(clock) as (runtime, loop):
        loop.subscriber.ingest(sample("10.0.0.1:8000", 0.2))
        found = runtime.endpoint_budget("m", "10.0.0.1:8000")
        assert found is not None
        key, held = found  # a waiter's booking holds this
        clock.now += loop.subscriber.config.forget_after + 1
        loop.tick()  # forgotten, and idle: dropped
        assert runtime.endpoint_budget("m", "10.0.0.1:8000") is None
        held.admit("w", 100, 10, now=clock.now)  # the waiter's turn comes
        runtime.budget_changed(key)
        loop.subscriber.ingest(sample("10.0.0.1:8000", 0.2, t=9e3))  # the engine is back
        back = runtime.endpoint_budget("m", "10.0.0.1:8000")
        assert back is not None and back[1] is held and held.leases == 1
