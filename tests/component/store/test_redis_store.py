"""What only a shared store must get right: several replicas, dead replicas, Redis going away, key hygiene."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
from collections.abc import AsyncIterator, Iterator

import pytest
import redis

from extproc.core.limiter.limiter import Lease, LimitSpec, Reason, Rejection
from extproc.store.redis import BREAKER_OPEN_S, RedisStore, StoreUnavailable
from tests.component.store.redis_server import RedisServer

LIMITS = {
    "global": LimitSpec(max_concurrency=10, tokens_per_minute=60_000),
    "model:m": LimitSpec(max_concurrency=8),
}


async def replica(url: str, **kwargs: float) -> RedisStore:
    store = RedisStore.from_url(url, **kwargs)  # type: ignore[arg-type]
    await store.start()
    await store.apply_limits(LIMITS)
    return store


@pytest.fixture
async def pair(redis_url: str) -> AsyncIterator[tuple[RedisStore, RedisStore]]:
    a, b = await replica(redis_url, timeout_s=1.0), await replica(redis_url, timeout_s=1.0)
    yield a, b
    await a.close()
    await b.close()


async def test_two_replicas_never_exceed_one_global_limit(pair: tuple[RedisStore, RedisStore]) -> None:
    """`in_flight` counts leases certainly held in Redis (up before the hold, down before the release)."""
    in_flight, high, admitted, refused = 0, 0, 0, 0

    async def client(store: RedisStore) -> None:
        nonlocal in_flight, high, admitted, refused
        for _ in range(25):
            result = await store.acquire(["global", "model:m"], 10)
            if isinstance(result, Rejection):
                refused += 1
                await asyncio.sleep(0.001)
                continue
            in_flight += 1
            admitted += 1
            high = max(high, in_flight)
            await asyncio.sleep(random.uniform(0.002, 0.02))
            in_flight -= 1
            assert await store.release(result, 10)

    await asyncio.gather(*(client(pair[i % 2]) for i in range(40)))
    assert high <= 8  # model:m's limit is the tighter one
    assert admitted > 50 and refused > 50  # real contention from both replicas
    status = await pair[0].status(["global", "model:m"])
    assert status.remaining_requests == 8  # everything came back


async def test_two_replicas_take_from_one_bucket(pair: tuple[RedisStore, RedisStore]) -> None:
    for store in pair:
        await store.apply_limits({"global": LimitSpec(tokens_per_minute=60)})  # 1 token/s
    results = await asyncio.gather(*(pair[i % 2].acquire(["global"], 10) for i in range(20)))
    assert sum(isinstance(r, Lease) for r in results) == 6


async def test_settling_once_holds_across_replicas(pair: tuple[RedisStore, RedisStore]) -> None:
    a, b = pair
    await a.apply_limits({"global": LimitSpec(max_concurrency=2, tokens_per_minute=600)})
    await b.apply_limits({"global": LimitSpec(max_concurrency=2, tokens_per_minute=600)})
    lease = await a.acquire(["global"], 300)
    assert isinstance(lease, Lease)
    copy = dataclasses.replace(lease)
    assert await a.release(lease, 0) is True
    assert await b.release(copy, 0) is False  # Redis knows it is settled: no second refund, no slot freed
    snap = {s.key: s for s in b.snapshot()}["global"]
    assert snap.active == 0 and snap.tokens_available == pytest.approx(600)


async def test_a_dead_replicas_leases_expire_and_slots_come_back(redis_url: str) -> None:
    a = await replica(redis_url, lease_ttl_s=1.0, timeout_s=1.0)
    b = await replica(redis_url, lease_ttl_s=1.0, timeout_s=1.0)
    try:
        held = [await a.acquire(["model:m"], 0) for _ in range(8)]
        assert all(isinstance(x, Lease) for x in held)
        rej = await b.acquire(["model:m"], 0)
        assert isinstance(rej, Rejection) and rej.reason is Reason.CONCURRENCY
        await a.close()  # the replica dies: no release, no renewal
        await asyncio.sleep(0.5)
        assert isinstance(await b.acquire(["model:m"], 0), Rejection)
        await asyncio.sleep(0.7)
        got = [await b.acquire(["model:m"], 0) for _ in range(8)]
        assert all(isinstance(x, Lease) for x in got)
    finally:
        await b.close()


async def test_renewal_keeps_a_long_lease_counted(redis_url: str) -> None:
    a = await replica(redis_url, lease_ttl_s=0.6, timeout_s=1.0)
    b = await replica(redis_url, lease_ttl_s=0.6, timeout_s=1.0)
    try:
        await a.apply_limits({"model:m": LimitSpec(max_concurrency=1)})
        await b.apply_limits({"model:m": LimitSpec(max_concurrency=1)})
        lease = await a.acquire(["model:m"], 0)
        assert isinstance(lease, Lease)
        for _ in range(4):  # 1.6 s: nearly three TTLs
            await asyncio.sleep(0.4)
            assert isinstance(await b.acquire(["model:m"], 0), Rejection)
        assert await a.release(lease, 0)
        assert isinstance(await b.acquire(["model:m"], 0), Lease)
    finally:
        await a.close()
        await b.close()


async def test_keys_are_prefixed_and_all_expire(redis_url: str, redis_server: RedisServer) -> None:
    store = await replica(redis_url, timeout_s=1.0)
    await store.apply_limits(
        {"model:m": LimitSpec(max_concurrency=4, tokens_per_minute=600)},
        defaults={"tenant:": LimitSpec(max_concurrency=1, tokens_per_minute=600)},
    )
    try:
        odd = ["tenant:a", "tenant:a:b", "tenant:{x}", "tenant:a b|c"]
        leases = [await store.acquire(["model:m", k], 100) for k in odd]
        assert all(isinstance(x, Lease) for x in leases)  # keys that look alike do not share a count
        for lease in leases[:2]:
            assert isinstance(lease, Lease)
            await store.release(lease, 50)
        with redis.Redis.from_url(redis_server.url) as client:
            keys = list(client.scan_iter("*"))
            assert keys and all(k.startswith(b"extproc:{limits}:") for k in keys)
            assert all(client.ttl(k) > 0 for k in keys)  # nothing lives forever
    finally:
        await store.close()


async def test_a_lease_lost_while_redis_was_unreachable_is_not_revived(redis_url: str) -> None:
    store = await replica(redis_url, lease_ttl_s=0.5, timeout_s=0.2)
    try:
        lease = await store.acquire(["model:m"], 0)
        assert isinstance(lease, Lease)
        for task in store._tasks:  # renewals stall, as if Redis had been unreachable for a while
            task.cancel()
        await asyncio.sleep(0.7)
        assert await store.renew() == 0
        assert store.lost_leases == 1
        assert await store.release(lease, 0) is False
        assert {s.key: s for s in store.snapshot()}["model:m"].active == 0
    finally:
        await store.close()


# -- Redis going away --------------------------------------------------------------------------------------


@pytest.fixture
def own_server() -> Iterator[RedisServer]:
    """A server this test may kill or pause without disturbing the others."""
    server = RedisServer()
    server.start()
    yield server
    server.stop()


async def test_redis_killed_raises_store_unavailable_fast_and_recovers(own_server: RedisServer) -> None:
    store = await replica(own_server.url, timeout_s=0.1)
    try:
        lease = await store.acquire(["model:m"], 0)
        assert isinstance(lease, Lease)
        own_server.kill()
        for _ in range(5):
            t0 = time.monotonic()
            with pytest.raises(StoreUnavailable):
                await store.acquire(["model:m"], 0)
            assert time.monotonic() - t0 < 0.3
        assert not store.available  # repeated failures: failing fast now
        assert await store.release(lease, 0) is True  # settled locally; Redis is left to expiry or a retry
        assert store.snapshot()  # metrics still answer, from the cache
        own_server.start()  # same port, empty: the scripts are gone too
        await asyncio.sleep(BREAKER_OPEN_S + 0.1)
        # Empty means the state was lost: admissions wait while replicas re-assert their leases.
        assert isinstance(await admitted_within(store, store.recovery_s + 2 * store.guard_interval_s), Lease)
    finally:
        await store.close()


async def test_acquires_refused_while_failing_fast_leave_nothing_behind(own_server: RedisServer) -> None:
    """A refusal by the open breaker sent nothing, so it spawns no forget: a failover refuses thousands of
    requests, whose forgets would all come due together when Redis answers again and hold its connections."""
    store = await replica(own_server.url, timeout_s=0.1)
    try:
        own_server.kill()
        while store.available:
            with pytest.raises(StoreUnavailable):
                await store.acquire(["model:m"], 0)
        pending = len(store.background)
        for _ in range(50):
            with pytest.raises(StoreUnavailable):
                await store.acquire(["model:m"], 0)
        assert len(store.background) <= pending
    finally:
        await store.close()


async def admitted_within(store: RedisStore, seconds: float) -> Lease | Rejection | None:
    """The first answer of the store within `seconds` (None: it was unavailable throughout)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            return await store.acquire(["model:m"], 0)
        except StoreUnavailable:
            await asyncio.sleep(0.05)
    return None


async def test_redis_paused_never_hangs_a_request(own_server: RedisServer) -> None:
    store = await replica(own_server.url, timeout_s=0.1)
    try:
        lease = await store.acquire(["model:m"], 0)
        assert isinstance(lease, Lease)
        own_server.pause()
        t0 = time.monotonic()
        with pytest.raises(StoreUnavailable):
            await store.acquire(["model:m"], 0)
        assert time.monotonic() - t0 < 0.3
        t0 = time.monotonic()
        assert await store.release(lease, 0) is True  # retried in the background
        assert time.monotonic() - t0 < 0.3
        own_server.resume()
        # The refused acquire took nothing (or is taken back), the release lands: nothing is held.
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            try:
                status = await store.status(["model:m"])
            except StoreUnavailable:
                status = None
            if status is not None and status.remaining_requests == 8:
                break
            await asyncio.sleep(0.1)
        assert status is not None and status.remaining_requests == 8
    finally:
        own_server.resume()
        await store.close()


async def test_start_with_redis_down_does_not_crash(own_server: RedisServer) -> None:
    own_server.kill()
    store = RedisStore.from_url(own_server.url, timeout_s=0.1)
    await store.start()
    await store.apply_limits(LIMITS)  # logged, not raised
    with pytest.raises(StoreUnavailable):
        await store.acquire(["model:m"], 0)
    own_server.start()
    await asyncio.sleep(BREAKER_OPEN_S + 0.1)
    assert isinstance(await store.acquire(["model:m"], 0), Lease)
    await store.close()
