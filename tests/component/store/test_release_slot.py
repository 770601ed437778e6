"""`LimiterStore.release_slot` where only a shared store can go wrong: the lease renewed past its TTL while it
waits for its settlement, a reply lost after the slots were given back, Redis losing its state, and the
fallback store's local shadow slot. The behaviour every store shares is in tests/support/limiter_cases.py
(`a_slot_given_back_...`), run on one Redis and a Redis Cluster by test_parity.py."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis

from extproc.core.limiter.limiter import Lease, LimitSpec, Rejection
from extproc.store.fallback import FallbackStore
from extproc.store.local import LocalStore
from extproc.store.redis import RedisStore
from tests.component.store.redis_server import RedisServer

TPM = 6000
FREED = "extproc:{limits}:u"
"""The set of leases whose slots were given back (`P u` in extproc/store/redis/scripts.py)."""


async def replica(url: str, **kwargs: float) -> RedisStore:
    store = RedisStore.from_url(url, timeout_s=1.0, **kwargs)  # type: ignore[arg-type]
    await store.start()
    await store.apply_limits({"m": LimitSpec(max_concurrency=1, tokens_per_minute=TPM)})
    return store


async def held(store: RedisStore, tokens: int) -> Lease:
    lease = await store.acquire(["m"], tokens)
    assert isinstance(lease, Lease)
    return lease


def tokens(value: float) -> object:
    return pytest.approx(value, abs=TPM / 60 * 0.5)


async def test_a_lease_without_its_slot_is_renewed_until_its_release_settles_it(redis_url: str) -> None:
    a = await replica(redis_url, lease_ttl_s=0.6)
    b = await replica(redis_url, lease_ttl_s=0.6)
    try:
        lease = await held(a, 3000)
        assert await a.release_slot(lease)
        other = await held(b, 0)  # the slot, taken on another replica
        await asyncio.sleep(1.6)  # nearly three TTLs: renewals keep it in `P u`
        assert a.lost_leases == 0
        assert await a.release(lease, 1000)  # still alive: settled to what was used, not written off
        status = await b.status(["m"])
        # 1.6 s of refill on top: written off, it would read 2000 fewer
        assert status.remaining_tokens == pytest.approx(TPM - 1000 + 1.6 * TPM / 60, abs=300)
        assert status.remaining_requests == 0  # `other` holds the one slot; nothing freed twice
        assert await b.release(other, 0)
        with redis.Redis.from_url(redis_url) as client:
            assert client.zcard(FREED) == 0  # nothing left behind
    finally:
        await a.close()
        await b.close()


async def test_a_lost_reply_leaves_the_slot_free_at_renewal(redis_url: str) -> None:
    """The script gave the slots back but its reply never came: the replica still thinks it holds them, and
    its renewal must not take them again."""
    store = await replica(redis_url)
    try:
        lease = await held(store, 600)
        assert await store.release_slot(lease)
        lease.slot_released = False  # as if the reply had been lost
        assert await store.renew() == 1
        assert store.health().restored_leases == 0
        assert (await store.status(["m"])).remaining_requests == 1
        other = await held(store, 0)
        assert isinstance(await store.acquire(["m"], 0), Rejection)
        assert await store.release(lease, 600)
        assert (await store.status(["m"])).remaining_requests == 0  # `other`'s slot stays taken
        assert await store.release(other, 0)
    finally:
        await store.close()


async def test_a_lease_redis_lost_is_restored_without_its_slot(redis_url: str) -> None:
    store = await replica(redis_url)
    try:
        lease = await held(store, 600)
        assert await store.release_slot(lease)
        with redis.Redis.from_url(redis_url) as client:
            client.delete(FREED)  # evicted, say
            assert await store.renew() == 1
            assert store.health().restored_leases == 1
            assert client.zscore(FREED, str(lease.lease_id)) is not None
        assert (await store.status(["m"])).remaining_requests == 1  # restored, but not into the slot
        assert await store.release(lease, 600)
    finally:
        await store.close()


async def test_a_store_that_cannot_answer_says_false_and_the_release_frees_the_slot_once(
    redis_server: RedisServer, redis_url: str
) -> None:
    """Redis stopped: the call times out (False, never raises) though the script may run once Redis
    resumes; either way the slot comes back exactly once, and the tokens settle."""
    store = await replica(redis_url)
    try:
        lease = await held(store, 3000)
        since = time.monotonic()
        redis_server.pause()
        try:
            assert await store.release_slot(lease) is False
        finally:
            redis_server.resume()
        assert not lease.slot_released
        assert await store.renew() == 1  # kept where the script left it, never in the slot twice
        assert (await store.status(["m"])).remaining_requests == 1  # it ran once Redis resumed
        assert await store.release(lease, 2000)
        refilled = (time.monotonic() - since) * TPM / 60
        status = await store.status(["m"])
        assert status.remaining_requests == 1
        assert status.remaining_tokens == pytest.approx(TPM - 2000 + refilled, abs=50)
    finally:
        await store.close()


async def test_the_fallback_store_frees_the_shadow_slot_with_the_shared_one(redis_url: str) -> None:
    store = FallbackStore(RedisStore.from_url(redis_url, timeout_s=1.0), LocalStore(), 0.5)
    await store.start()
    await store.apply_limits({"global": LimitSpec(max_concurrency=4, tokens_per_minute=TPM)})
    try:
        lease = await store.acquire(["global"], 600)
        assert isinstance(lease, Lease)
        assert store.fallback.snapshot()[0].active == 1  # its shadow
        assert await store.release_slot(lease)
        assert store.fallback.snapshot()[0].active == 0
        assert (await store.status(["global"])).remaining_requests == 4
        assert await store.release_slot(lease) is False
        assert await store.release(lease, 60)
        assert store.fallback.snapshot()[0].active == 0
        status = await store.status(["global"])
        assert status.remaining_requests == 4 and status.remaining_tokens == tokens(TPM - 60)
    finally:
        await store.close()
