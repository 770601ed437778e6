"""The KV budget behind the feed: config keys, engine readings per sample, and what a stale feed leaves."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from prometheus_client import CollectorRegistry

from extproc.config import ConfigError, parse_config
from extproc.core.engine.adaptive import AdaptiveConfig, ControllerState
from extproc.core.kv.budget import BookingMode
from extproc.kvfeed.engines import ServerKind
from extproc.kvfeed.sample import FeedSample
from extproc.kvfeed.subscriber.aggregate import PoolSnapshot
from extproc.kvfeed.subscriber.loop import FeedbackLoop
from extproc.kvfeed.subscriber.metrics import register_feedback_metrics
from extproc.kvfeed.subscriber.runtime import FeedbackRuntime
from extproc.kvfeed.subscriber.settings import SubscriberConfig

FEED = {"direct_targets": [{"url": "http://127.0.0.1:1/metrics", "kind": "vllm", "model": "m"}]}


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def sample(kv: float | None, cap: int | None = 1000, *, up: bool = True, t: float = 1.0) -> FeedSample:
    return FeedSample("node", "a:1", "m", ServerKind.VLLM, kv, 0.0, 1.0, 0.0, cap, t, up)


def test_booking_defaults_to_forecast_and_is_validated() -> None:
    config = parse_config({"feedback": FEED, "kv_budget": {"enabled": True}})
    assert config.feedback.kv_budget.booking == "forecast"
    config = parse_config({"feedback": FEED, "kv_budget": {"enabled": True, "booking": "lifetime"}})
    assert config.feedback.kv_budget.booking == "lifetime"
    for bad in ("weekly", 3):
        with pytest.raises(ConfigError) as err:
            parse_config({"feedback": FEED, "kv_budget": {"enabled": True, "booking": bad}})
        assert str(err.value).startswith("kv_budget.booking"), str(err.value)


def test_loop_reports_fresh_samples_only() -> None:
    clock = Clock()
    seen: list[tuple[str, PoolSnapshot, float]] = []
    loop = FeedbackLoop(
        SubscriberConfig(exporters=("127.0.0.1:1",)),
        {"m": AdaptiveConfig()},
        clock,
        on_sample=lambda pool, snap, now: seen.append((pool, snap, now)),
    )
    loop.subscriber.ingest(sample(0.25, t=1.0))
    assert [(pool, snap.kv_used_tokens, now) for pool, snap, now in seen] == [("m", 250.0, 100.0)]
    loop.subscriber.ingest(sample(None, t=2.0, up=False))  # a failed scrape: nothing to read
    assert len(seen) == 1


def test_on_sample_exceptions_do_not_escape() -> None:
    def boom(pool: str, snap: PoolSnapshot, now: float) -> None:
        raise RuntimeError("sidecar bug")

    loop = FeedbackLoop(SubscriberConfig(exporters=("h:1",)), {}, Clock(), on_sample=boom)
    loop.subscriber.ingest(sample(0.1))
    assert "m" in loop.states()


async def budget_runtime(clock: Clock) -> FeedbackRuntime:
    """A runtime fed by `FEED` whose budgets book against 0.9 of the cache, fair shares off (the booking's
    arithmetic alone): the caller stops it."""
    runtime = FeedbackRuntime(CollectorRegistry(), lambda key, scale: None, clock)
    budget_config = {"enabled": True, "target_utilization": 0.9, "fair_shares": False}
    await runtime.apply(parse_config({"feedback": FEED, "kv_budget": budget_config}).feedback, ["m"])
    return runtime


def test_runtime_feeds_engine_readings_and_keeps_capacity_when_stale() -> None:
    async def scenario() -> None:
        clock = Clock()
        scales: list[tuple[str, float]] = []
        runtime = FeedbackRuntime(CollectorRegistry(), lambda key, scale: scales.append((key, scale)), clock)
        config = parse_config(
            {
                "feedback": FEED,
                "adaptive": {"stale_after_seconds": 5},
                # The booking's arithmetic alone: no claim left by the refusal below (fair shares).
                "kv_budget": {"enabled": True, "target_utilization": 0.5, "fair_shares": False},
            }
        ).feedback
        await runtime.apply(config, ["m"])
        try:
            assert runtime.loop is not None
            runtime.loop.subscriber.ingest(sample(0.3, t=1.0))
            budget = runtime.budget("m")
            assert budget is not None and budget.booking is BookingMode.FORECAST
            assert budget.capacity_tokens == 1000 and budget.forecasting(clock.now)
            assert budget.unexplained_tokens == 300  # nothing admitted here holds it
            assert budget.would_fit(150, 50, now=clock.now) == (True, 200)
            budget.admit("a", 150, 50, now=clock.now)
            assert not budget.would_fit(10, 0, now=clock.now)[0]

            clock.now += 6.0  # no sample for longer than stale_after_seconds
            runtime.loop.evaluate()
            state = runtime.loop.state("m")
            assert isinstance(state, ControllerState) and state.stale
            # Blind: the last capacity stays and whole lifetimes are booked, never "everything fits".
            assert budget.capacity_tokens == 1000 and not budget.forecasting(clock.now)
            assert budget.would_fit(300, 0, now=clock.now) == (True, 500 - 200)
            assert budget.would_fit(301, 0, now=clock.now) == (False, 300)
        finally:
            await runtime.stop()

    asyncio.run(scenario())


def test_the_budget_books_a_pool_of_engines_as_full_as_its_fullest() -> None:
    """Two 1,000-token engines at 0.8 and 0.2, nothing admitted here: the budget reads 1,600 in use (0.8 of
    2,000), not the 1,000 the sum holds: at target 0.9, 200 tokens of room (800 by the sum)."""

    async def scenario() -> None:
        clock = Clock()
        runtime = await budget_runtime(clock)
        try:
            assert runtime.loop is not None
            runtime.loop.subscriber.ingest(sample(0.8, t=1.0))
            runtime.loop.subscriber.ingest(dataclasses.replace(sample(0.2, t=1.0), endpoint="b:1"))
            budget = runtime.budget("m")
            assert budget is not None and budget.capacity_tokens == 2000
            assert budget.unexplained_tokens == pytest.approx(1600)
            assert budget.would_fit(150, 0, now=clock.now) == (True, 200)  # 800 by the sum
            budget.admit("a", 150, 0, now=clock.now)
            assert budget.would_fit(50, 0, now=clock.now)[0]
            assert not budget.would_fit(51, 0, now=clock.now)[0]
        finally:
            await runtime.stop()

    asyncio.run(scenario())


def test_min_completion_ratio_reaches_each_pools_budget_and_is_validated() -> None:
    async def scenario() -> None:
        runtime = FeedbackRuntime(CollectorRegistry(), lambda key, scale: None, Clock())
        config = parse_config(
            {"feedback": FEED, "kv_budget": {"enabled": True, "min_completion_ratio": 0.25}}
        ).feedback
        await runtime.apply(config, ["m"])
        try:
            assert runtime.loop is not None
            runtime.loop.subscriber.ingest(sample(0.0))
            budget = runtime.budget("m")
            assert budget is not None
            for _ in range(40):  # a tenant whose answers stop after one token of 4,000
                budget.admit("x", 10, 4000, "tenant")
                budget.release("x", 1)
            assert budget.expected_completion(4000, "tenant") == 1000
        finally:
            await runtime.stop()

    asyncio.run(scenario())
    with pytest.raises(ConfigError) as err:
        parse_config({"feedback": FEED, "kv_budget": {"enabled": True, "min_completion_ratio": 0}})
    assert str(err.value).startswith("kv_budget.min_completion_ratio"), str(err.value)


class RunsBoard:
    """A `KvBoard` that records the pools whose runs it was handed, and has no other replica."""

    def __init__(self) -> None:
        self.kv: list[str] = []
        self.runs: list[str] = []

    async def exchange(self, pool: str, share: object) -> object:
        self.kv.append(pool)
        raise AssertionError("a pool without a KV budget has no KV figures to publish")

    async def exchange_runs(self, pool: str, figures: object) -> dict[str, object]:
        self.runs.append(pool)
        return {}


def test_a_pool_without_a_kv_budget_still_exchanges_its_runs_at_each_sample() -> None:
    """With `kv_budget` off the runs rode nothing: each replica charged the pool's whole growth to its own
    runs. Each sample now sends them alone."""

    async def scenario() -> None:
        runtime = FeedbackRuntime(CollectorRegistry(), lambda key, scale: None, Clock())
        board = RunsBoard()
        runtime.share_through(board, 0.5)  # type: ignore[arg-type]
        await runtime.apply(parse_config({"feedback": FEED}).feedback, ["m"])
        try:
            assert runtime.loop is not None and runtime.budget("m") is None
            counted = dataclasses.replace(sample(0.3, t=1.0), generation_tokens_total=100.0)
            runtime.loop.subscriber.ingest(counted)  # a tally needs the engine's generation counter
            for _ in range(10):
                await asyncio.sleep(0)
            assert board.runs == ["m"] and board.kv == []
        finally:
            await runtime.stop()

    asyncio.run(scenario())


def test_the_loop_sums_the_pools_prefilled_prompt_tokens_as_growth() -> None:
    """vLLM's `vllm:prompt_tokens_total` per endpoint, summed as growth from each one's first reading: what
    the KV budget takes as evidence that a lease was prefilled (`EngineCorrection._prefilled`)."""
    loop = FeedbackLoop(SubscriberConfig(exporters=("h:1",)), {}, Clock())
    loop.subscriber.ingest(sample(0.1, t=1.0))
    assert loop.prompted("m") is None  # the engine publishes no such counter
    loop.subscriber.ingest(dataclasses.replace(sample(0.1, t=2.0), prompt_tokens_total=40_000.0))
    assert loop.prompted("m") == 0.0  # a baseline
    loop.subscriber.ingest(dataclasses.replace(sample(0.1, t=3.0), prompt_tokens_total=41_500.0))
    assert loop.prompted("m") == 1_500.0
    loop.subscriber.ingest(sample(None, t=4.0, up=False))
    assert loop.prompted("m") is None


def test_the_tally_reads_a_sample_when_it_was_read_and_over_a_failed_scrape() -> None:
    """A slow scrape's counter was read when the busy server got to the page, just before it came (measured:
    at 0.93-0.99 of its duration), so its reading is stamped at the page's end, never its start; a failed
    scrape between two readings keeps the counter, so the growth over the gap counts at the next one."""
    clock = Clock()
    loop = FeedbackLoop(SubscriberConfig(exporters=("h:1",)), {}, clock, wall_clock=clock)

    def read(counter: float, duration: float = 0.0, running: float = 1.0) -> FeedSample:
        base = dataclasses.replace(sample(0.1, t=clock.now), generation_tokens_total=counter)
        return dataclasses.replace(base, scrape_duration_seconds=duration, requests_running=running)

    loop.subscriber.ingest(read(1_000.0, running=0.0))
    clock.now += 2.0
    loop.subscriber.ingest(read(1_500.0, duration=1.8))
    tally = loop.engine_tally("m")
    assert tally is not None
    assert tally.covers(clock.now)
    clock.now += 2.0
    loop.subscriber.ingest(sample(None, t=clock.now, up=False))
    clock.now += 2.0
    loop.subscriber.ingest(read(2_300.0))
    clock.now += 2.0
    loop.subscriber.ingest(read(2_300.0, running=0.0))
    tally.begin("x", 100.5, 1)  # alone on the engine from just after the first reading to 107
    tally.end("x", 107.0)
    assert tally.count(100.5, 107.0, 1, 0.5, key="x") == 1_300.0


def test_a_sample_that_came_late_is_read_into_the_tally_when_its_exporter_read_it() -> None:
    """Two requests one after the other, alone on the engine: x from 100.5 to 102 generates 500 tokens, y
    from 102.5 to 104 300. The readings at 102.2 and 104.2 reach the sidecar at 104.5 and 104.6 (a saturated
    host delivered samples seconds late, two at once): stamped on arrival, x's 500 tokens would fall in
    one interval with y's run, and x be counted 250 of them."""
    clock = Clock()
    registry = CollectorRegistry()
    metrics = register_feedback_metrics(registry)
    loop = FeedbackLoop(SubscriberConfig(exporters=("h:1",)), {}, clock, wall_clock=clock, metrics=metrics)

    def arrives(at: float, read_at: float, counter: float) -> None:
        clock.now = at
        base = dataclasses.replace(sample(0.1, t=read_at), generation_tokens_total=counter)
        loop.subscriber.ingest(dataclasses.replace(base, requests_running=0.0))

    arrives(100.0, 100.0, 1_000.0)
    tally = loop.engine_tally("m")
    assert tally is not None
    tally.begin("x", 100.5, 1)
    tally.end("x", 102.0)
    tally.begin("y", 102.5, 1)
    tally.end("y", 104.0)
    arrives(104.5, 102.2, 1_500.0)
    assert not tally.covers(104.0)  # read at 102.2: what came after is not in it
    arrives(104.6, 104.2, 1_800.0)
    arrives(106.0, 106.0, 1_800.0)
    assert tally.count(100.5, 102.0, 1, key="x") == 500.0
    assert tally.count(102.5, 104.0, 1, key="y") == 300.0
    delay = "extproc_feed_sample_delay_seconds"
    assert registry.get_sample_value(f"{delay}_count") == 4
    assert registry.get_sample_value(f"{delay}_sum") == pytest.approx(2.3 + 0.4)
    assert registry.get_sample_value(f"{delay}_bucket", {"le": "0.5"}) == 3


def test_the_feeds_pace_reaches_the_budget_with_the_running_count_it_was_read_at() -> None:
    """A pace of 100 tokens/s read with one request running; four leases admitted since run at a quarter of
    it at the least (`BudgetPace._at_batch`), until the feed reads their batch's own pace."""

    async def scenario() -> None:
        clock = Clock()
        runtime = await budget_runtime(clock)
        try:
            assert runtime.loop is not None
            alone = dataclasses.replace(sample(0.1, t=1.0), decode_tokens_per_second=100.0)
            runtime.loop.subscriber.ingest(alone)  # one request running (`sample`)
            budget = runtime.budget("m")
            assert budget is not None
            budget.pace.observe_stream(200.0, 1.0)  # a faster pace learned: the feed's bounds it
            assert budget.decode_rate() == 100.0
            for lease in range(4):
                budget.admit(f"burst {lease}", 100, 100, now=clock.now)
            assert budget.decode_rate() == 25.0
            batch = dataclasses.replace(
                alone, requests_running=4.0, decode_tokens_per_second=40.0, sample_time=2.0
            )
            runtime.loop.subscriber.ingest(batch)
            assert budget.decode_rate() == 40.0
        finally:
            await runtime.stop()

    asyncio.run(scenario())
