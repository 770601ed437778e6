"""The pools' KV-budget figures shared through a real Redis (`RedisKvBoard`, KV_POOL): each replica reads the
sum of the others', a dead replica's figures expire in server time, a Redis that does not answer is the
port's `StoreUnavailable`, and two replicas' budgets divide one pool by demand through it."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import AsyncIterator, Callable

import pytest

from extproc.core.engine.tally import EngineTally, RunFigures
from extproc.core.kv.budget import BookingMode, KvBudget
from extproc.core.kv.completion import CompletionLearner
from extproc.core.kv.fleet import FREE_HORIZONS_S, Claim, Peers, ReplicaShare, frees_by
from extproc.core.ports import StoreUnavailable
from extproc.kvfeed.subscriber import fleet as fleet_module
from extproc.kvfeed.subscriber.fleet import FleetExchange
from extproc.store.redis import RedisStore
from extproc.store.redis import kvboard as kvboard_module
from extproc.store.redis.kvboard import HORIZONS_ID
from tests.component.store.redis_cluster import RedisClusterNodes

A = ReplicaShare(booked=8_000, held=6_000, settled=8, candidates=2)
B = ReplicaShare(booked=1_000, held=900, settled=1, candidates=0)


async def test_each_replica_reads_the_sum_of_the_others(redis_url: str) -> None:
    stores = [RedisStore.from_url(redis_url, timeout_s=1.0) for _ in range(3)]
    try:
        a, b, c = (store.kv_board() for store in stores)
        assert await a.exchange("llama", A) == Peers(ReplicaShare(), 0)
        assert await b.exchange("llama", B) == Peers(A, 1)
        assert await c.exchange("llama", ReplicaShare()) == Peers(A.plus(B), 2)
        assert await a.exchange("llama", A) == Peers(B, 2)  # its own figures replaced, not added
        assert await a.exchange("mistral", A) == Peers(ReplicaShare(), 0)  # pools apart
    finally:
        for store in stores:
            await store.close()


async def test_the_answer_says_what_the_others_that_do_not_yield_have_heard(redis_url: str) -> None:
    """An asking replica takes its part once every other that does not yield has taken in an answer later
    than its ask (`Claim.ASKING`): the answer carries the server's time and the least of what those had
    heard, sums who yields, and leaves out a replica of a version before yielding (four figures)."""
    stores = [RedisStore.from_url(redis_url, timeout_s=1.0) for _ in range(3)]
    try:
        a, b, c = (store.kv_board() for store in stores)
        first = await a.exchange("llama", A)
        assert first.oldest_ms == -1  # nobody else: the ask is heard at once
        second = await b.exchange("llama", ReplicaShare(booked=10, yielding=1, heard_ms=first.now_ms))
        assert second.oldest_ms == 0 and second.now_ms >= first.now_ms  # a had heard nothing yet
        third = await c.exchange("llama", ReplicaShare(booked=20, heard_ms=77))
        assert third.share.yielding == 1 and third.oldest_ms == 0
        again = await a.exchange("llama", ReplicaShare(booked=8_000, heard_ms=third.now_ms))
        assert again.oldest_ms == 77  # b yields: only c's counts
        raw = stores[0].calls.client  # a replica of the version before yielding: four figures
        key = f"{stores[0].calls.base}kv:5:llama"
        await raw.hset(key, "r:old", f"{again.now_ms + 60_000} 5 5 1 0")
        assert (await a.exchange("llama", A)).oldest_ms == 77
    finally:
        for store in stores:
            await store.close()


async def test_the_others_frees_are_summed_from_the_moment_of_the_answer(redis_url: str) -> None:
    """Each replica says what its leases will have freed by each horizon after it published
    (`ReplicaShare.frees`); the answer sums the others' by the same horizons counted from the server's now,
    each carried forward by its age, and a field of a version before frees (six figures) frees nothing."""
    stores = [RedisStore.from_url(redis_url, timeout_s=1.0) for _ in range(3)]
    try:
        a, b, c = (store.kv_board() for store in stores)
        await a.exchange("llama", ReplicaShare(booked=900, frees=frees_by([(4.0, 900)], 900)))
        await b.exchange("llama", ReplicaShare(booked=500, frees=frees_by([(15.0, 500)], 500)))
        read = await c.exchange("llama", ReplicaShare())
        assert read.share.frees == frees_by([(4.0, 900), (15.0, 500)], 1_400)
        raw = stores[0].calls.client
        key = f"{stores[0].calls.base}kv:5:llama"
        expiry = read.now_ms + 4_000
        await raw.hset(key, "r:old", f"{expiry} 5 5 1 0 0 77")  # a version before frees: heard 77, no more
        other = (HORIZONS_ID + 1, *(700 for _ in FREE_HORIZONS_S))
        other_horizons = f"{expiry} 5 5 1 0 0 77 " + " ".join(map(str, other))
        await raw.hset(key, "r:other", other_horizons)
        assert (await c.exchange("llama", ReplicaShare())).share.frees == read.share.frees
        await raw.hdel(key, "r:old", "r:other")
        await asyncio.sleep(2.1)  # server time: a's release is under 2 s from now, b's under 12.9 s
        aged = await c.exchange("llama", ReplicaShare())
        assert aged.share.frees == frees_by([(2.0, 900), (15.0, 500)], 1_400)
    finally:
        for store in stores:
            await store.close()


async def test_a_replica_that_stops_publishing_stops_counting(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(kvboard_module, "REPLICA_TTL_S", 0.3)
    a, b = RedisStore.from_url(redis_url, timeout_s=1.0), RedisStore.from_url(redis_url, timeout_s=1.0)
    try:
        await a.kv_board().exchange("llama", A)
        assert (await b.kv_board().exchange("llama", B)).replicas == 1
        await asyncio.sleep(0.5)  # server time: the figures' expiry is Redis's clock, not this one's
        assert await b.kv_board().exchange("llama", B) == Peers(ReplicaShare(), 0)
    finally:
        await a.close()
        await b.close()


async def test_a_redis_that_does_not_answer_is_store_unavailable() -> None:
    store = RedisStore.from_url("redis://127.0.0.1:1/0", timeout_s=0.2)
    try:
        with pytest.raises(StoreUnavailable):
            await store.kv_board().exchange("llama", A)
    finally:
        await store.close()


async def test_on_a_cluster_the_figures_live_in_the_stores_one_slot(
    redis_cluster: RedisClusterNodes, cluster_url: str
) -> None:
    a = RedisStore.from_url(cluster_url, mode="cluster", timeout_s=1.0)
    b = RedisStore.from_url(cluster_url, mode="cluster", timeout_s=1.0)
    try:
        await a.kv_board().exchange("llama", A)
        assert await b.kv_board().exchange("llama", B) == Peers(A, 1)
    finally:
        await a.close()
        await b.close()


def budget() -> KvBudget:
    learner = CompletionLearner(min_samples=10**6)
    b = KvBudget(10_000, target_utilization=1.0, booking=BookingMode.FORECAST, learner=learner)
    b.pace.observe_stream(100, 1.0)
    b.share_through_store(fallback_share=0.5)
    b.observe_engine(0, now=0.0, fresh_for=1e9, waiting=0, running=0)
    return b


async def exchanged(fleet: FleetExchange, budget: KvBudget) -> None:
    """One more exchange of `budget`'s figures (the interval between two may delay it), and any it owes."""
    before = fleet.exchanges + fleet.failures
    fleet.changed("llama", budget)
    for _ in range(100):
        await asyncio.sleep(0.01)
        if fleet.exchanges + fleet.failures > before and not fleet._tasks:
            return
    raise AssertionError("no exchange")


async def test_two_replicas_divide_a_pool_by_demand_through_redis(redis_url: str) -> None:
    stores = [RedisStore.from_url(redis_url, timeout_s=1.0) for _ in range(2)]
    clock = [0.0]
    busy_budget, idle_budget = budget(), budget()
    busy = FleetExchange(stores[0].kv_board(), clock=lambda: clock[0])
    idle = FleetExchange(stores[1].kv_board(), clock=lambda: clock[0])
    try:
        await exchanged(idle, idle_budget)
        await exchanged(busy, busy_budget)  # the busy replica's ask
        await exchanged(idle, idle_budget)  # heard: the idle one, which never decided, yields meanwhile
        admitted = 0
        for step in range(6):  # all the free room but the idle replica's sliver at each exchange
            await exchanged(busy, busy_budget)
            while busy_budget.would_fit(500, 500, now=step * 0.1)[0]:
                busy_budget.admit(f"a{admitted}", 500, 500, now=step * 0.1)
                admitted += 1
        assert admitted >= 9  # past the 5 of a fixed half
        clock[0] = 1.0
        await exchanged(busy, busy_budget)
        await exchanged(idle, idle_budget)
        assert not idle_budget.would_fit(500, 500, now=1.0)[0]  # its sliver; now it asks
        await exchanged(idle, idle_budget)
        await exchanged(busy, busy_budget)
        await exchanged(idle, idle_budget)
        assert 0 < (idle_budget.budget_tokens or 0) <= 1_000  # half of what the busy one left
        assert not idle_budget.would_fit(2_000, 1_000, now=1.0)[0]
    finally:
        await busy.close()
        await idle.close()
        for store in stores:
            await store.close()


Pair = tuple[Callable[[], float], FleetExchange, KvBudget, FleetExchange, KvBudget]


@contextlib.asynccontextmanager
async def busy_beside_quiet(redis_url: str) -> AsyncIterator[Pair]:
    """Two replicas on one Redis, each taking its part (deciding: neither yields), the busy one holding 9,000
    of the pool's 10,000 tokens in answers that end ~0.5 s later, the quiet one nothing; their clock is real
    (the exchange plans its reads on the loop's timers)."""
    stores = [RedisStore.from_url(redis_url, timeout_s=1.0) for _ in range(2)]
    start = time.monotonic()

    def clock() -> float:
        return time.monotonic() - start

    busy_budget, quiet_budget = budget(), budget()
    busy, quiet = FleetExchange(stores[0].kv_board(), clock), FleetExchange(stores[1].kv_board(), clock)
    try:
        for _ in range(3):  # each asks, and hears the other
            for fleet, deciding in ((busy, busy_budget), (quiet, quiet_budget)):
                deciding.would_fit(0, 0, now=clock())
                await exchanged(fleet, deciding)
        assert busy_budget.fleet.claim is Claim.FULL and quiet_budget.fleet.claim is Claim.FULL
        for i in range(9):
            busy_budget.admit(f"a{i}", 950, 50, now=clock())
        await exchanged(busy, busy_budget)
        await exchanged(quiet, quiet_budget)
        yield clock, busy, busy_budget, quiet, quiet_budget
    finally:
        await busy.close()
        await quiet.close()
        for store in stores:
            await store.close()


async def test_a_replica_reads_the_others_again_when_its_refused_client_comes_back(redis_url: str) -> None:
    """A refusal counted on the other replica's releases (`Fleet.others_releases`): the room is this
    replica's only once it has read them, and a replica that admits nothing meanwhile reads only at its feed's
    samples; so the exchange reads again at the moment the client was told (`FleetExchange._plan_reads`),
    and the client, back then, finds the room."""
    async with busy_beside_quiet(redis_url) as (clock, busy, busy_budget, quiet, quiet_budget):
        assert not quiet_budget.would_fit(500, 500, now=clock())[0]
        hint = quiet_budget.retry_after(clock())
        assert hint is not None and hint < 1.5  # the busy replica's ends: this one holds nothing
        back_at = clock() + hint
        await exchanged(quiet, quiet_budget)  # the refusal's reads planned, and an exchange before the ends
        for i in range(9):
            busy_budget.release(f"a{i}", 50)
        await exchanged(busy, busy_budget)
        await asyncio.sleep(max(0.0, back_at - clock()))
        while not quiet_budget.would_fit(500, 500, now=clock())[0]:  # the read's round trip, on a loaded host
            assert clock() < back_at + 1.0, "the others' releases were never read"
            await asyncio.sleep(0.02)


async def test_a_forgotten_budget_has_its_planned_reads_cancelled(redis_url: str) -> None:
    """An engine's budget goes once the feed forgets the engine (`FleetExchange.forget`): the reads planned
    for its refused clients go with it, rather than publish a dropped budget's figures again."""
    async with busy_beside_quiet(redis_url) as (clock, _busy, _busy_budget, quiet, quiet_budget):
        assert not quiet_budget.would_fit(500, 500, now=clock())[0]
        hint = quiet_budget.retry_after(clock())
        assert hint is not None
        await exchanged(quiet, quiet_budget)  # the reads planned
        quiet.forget("llama")
        before = quiet.exchanges
        await asyncio.sleep(hint + 0.3)
        assert quiet.exchanges == before


async def test_each_replica_reads_the_others_runs_carried_to_now(redis_url: str) -> None:
    """The engine tally's figures (`RUNS_POOL`): each other live replica's by name, its sequence-seconds
    grown at its running sequences since it published (Redis's clock), and where it runs none its seconds
    idle grown too, its own figures left out."""
    stores = [RedisStore.from_url(redis_url, timeout_s=1.0) for _ in range(2)]
    try:
        a, b = (store.kv_board() for store in stores)
        assert await a.exchange_runs("llama", RunFigures(10.0, 4.0, 6.0, 2.0)) == {}
        await asyncio.sleep(0.25)
        others = await b.exchange_runs("llama", RunFigures(1.5, 0.0, 1.0, idle=2.0))
        ((name, figures),) = others.items()
        assert name == f"r:{stores[0].calls.replica}"
        assert (figures.running, figures.shown, figures.left, figures.idle) == (4.0, 6.0, 2.0, 0.0)
        assert 10.0 + 4 * 0.2 <= figures.seconds <= 10.0 + 4 * 1.0  # 0.25 s of four sequences, Redis's time
        await asyncio.sleep(0.25)
        ((name, figures),) = (await a.exchange_runs("llama", RunFigures(11.0, 0.0, 0.0))).items()
        assert name == f"r:{stores[1].calls.replica}"
        assert (figures.seconds, figures.running, figures.shown, figures.left) == (1.5, 0.0, 1.0, 0.0)
        assert 2.0 + 0.2 <= figures.idle <= 2.0 + 1.0  # idle 0.25 s longer, Redis's time
        assert await a.exchange_runs("mistral", RunFigures()) == {}  # pools apart
    finally:
        for store in stores:
            await store.close()


def tally_of(tally: EngineTally, pool: str) -> EngineTally:
    return tally


@contextlib.asynccontextmanager
async def two_replicas(
    redis_url: str,
) -> AsyncIterator[tuple[list[float], list[EngineTally], list[FleetExchange]]]:
    """Two replicas on one Redis, each with a tally of the pool and its exchange, on one fake clock (at 5)."""
    stores = [RedisStore.from_url(redis_url, timeout_s=1.0) for _ in range(2)]
    clock = [5.0]
    tallies = [EngineTally(), EngineTally()]
    exchanges = [
        FleetExchange(store.kv_board(), clock=lambda: clock[0], tally_of=functools.partial(tally_of, tally))
        for store, tally in zip(stores, tallies, strict=True)
    ]
    try:
        yield clock, tallies, exchanges
    finally:
        for fleet in exchanges:
            await fleet.close()
        for store in stores:
            await store.close()


async def test_the_exchange_carries_each_pools_tally_runs_to_the_other_replicas(redis_url: str) -> None:
    """`FleetExchange` with a tally per replica: after both exchanged, each tally holds the other's runs
    (`PeerRuns`), so its split counts them beside its own."""
    async with two_replicas(redis_url) as (clock, tallies, exchanges):
        tallies[0].begin("a", 0.0, 2)  # two sequences running since 0: 10 sequence-seconds by 5
        await exchanged(exchanges[0], budget())
        await exchanged(exchanges[1], budget())
        assert tallies[1].peers.shown_at(5.0) == 2.0
        assert tallies[0].peers.shown_at(5.0) == 0.0  # the second replica had not published then
        clock[0] = 6.0  # one second more of the first replica's two sequences
        await exchanged(exchanges[0], budget())
        await exchanged(exchanges[1], budget())
        peers = tallies[1].peers
        assert peers.seconds_at(6.0) - peers.seconds_at(5.0) == pytest.approx(2.0, abs=0.1)


async def test_a_pool_without_a_kv_budget_exchanges_its_runs_alone(redis_url: str) -> None:
    """With `kv_budget` off nothing else publishes: each feed sample sends the pool's runs by themselves
    (`FleetExchange.runs_changed`), or each replica would charge the pool's whole growth to its own runs."""
    async with two_replicas(redis_url) as (_clock, tallies, exchanges):
        tallies[0].begin("a", 0.0, 2)
        for fleet in exchanges:
            fleet.runs_changed("llama")
            fleet.runs_changed("llama")  # one call in flight per pool: the second is dropped
            for _ in range(100):
                await asyncio.sleep(0.01)
                if not fleet._runs_tasks:
                    break
        assert tallies[1].peers.shown_at(5.0) == 2.0  # the first replica's two sequences
        assert fleet.exchanges == 0  # no KV figures went out: the pool has no budget


async def test_a_pool_whose_runs_went_out_once_keeps_them_fresh_without_a_feed_sample(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A replica that admits nothing new publishes at its feed's samples only; on a saturated host those
    came over `REPLICA_TTL_S` apart, its figures expired while its requests ran, and the other replica took
    their steps for its own. Once out, a pool's runs go out every `RUNS_EVERY_S` by themselves."""
    monkeypatch.setattr(fleet_module, "RUNS_EVERY_S", 0.05)
    async with two_replicas(redis_url) as (_clock, tallies, exchanges):
        tallies[0].begin("a", 0.0, 2)
        for fleet in exchanges:
            fleet.runs_changed("llama")
        tallies[0].begin("b", 5.0, 1)  # a third sequence, and nothing told to publish it
        for _ in range(200):
            await asyncio.sleep(0.01)
            if tallies[1].peers.shown_at(5.0) == 3.0:
                break
        assert tallies[1].peers.shown_at(5.0) == 3.0


async def test_the_answer_says_where_this_replicas_stamps_stop_coming_first(redis_url: str) -> None:
    """The fleet's order of waiting requests (`FleetOrder`): each answer carries the bound below which the
    caller's stamps come before every other replica's head (the least of them; one more where the caller's
    name is the lesser, which a tie goes to), 0 where no other has a head, and the least `heard` of all
    the others, yielding or not. A replica of a version before the order (no head in its figures) makes
    the bound -1: nobody takes the room ahead of it."""
    stores = [RedisStore.from_url(redis_url, timeout_s=1.0) for _ in range(3)]
    try:
        a, b, c = (store.kv_board() for store in stores)
        assert (await a.exchange("llama", ReplicaShare(head_ms=500))).bound == 0  # alone
        name = [f"r:{store.calls.replica}" for store in stores]  # the field names Lua compares, as strings
        assert (await b.exchange("llama", ReplicaShare(head_ms=400, heard_ms=7, yielding=1))).bound == 500 + (
            name[1] < name[0]
        )
        answer = await c.exchange("llama", ReplicaShare(heard_ms=9))
        assert answer.bound == 400 + (name[2] < name[1])
        assert answer.heard_all_ms == 0 and answer.oldest_ms == 0  # a had heard nothing; b yields
        again = await a.exchange("llama", ReplicaShare(head_ms=500, heard_ms=answer.now_ms))
        assert again.heard_all_ms == 7 and again.oldest_ms == 9
        raw = stores[0].calls.client  # a replica of the version before the order: no head in its figures
        frees = " ".join(["0"] * len(FREE_HORIZONS_S))
        old = f"{again.now_ms + 60_000} 0 0 0 0 0 0 {HORIZONS_ID} {frees}"
        await raw.hset(f"{stores[0].calls.base}kv:5:llama", "r:old", old)
        assert (await a.exchange("llama", ReplicaShare(head_ms=300))).bound == -1
    finally:
        for store in stores:
            await store.close()
