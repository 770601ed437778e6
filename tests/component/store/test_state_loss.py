"""A Redis that forgets: a flush with leases held, keys evicted, and an eviction policy that could do it.

Each case fails on a store that trusts whatever Redis holds: after a `FLUSHALL` it admitted a full second
set of requests on top of those still running, and it ran on a Redis that evicts keys under `maxmemory`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator

import pytest
import redis
from prometheus_client import generate_latest

from extproc.core.limiter.limiter import Lease, LimitSpec, Rejection
from extproc.core.ports import StoreUnavailable
from extproc.metrics import Metrics
from extproc.store.redis import RedisStore
from tests.component.store.redis_cluster import RedisClusterNodes
from tests.component.store.redis_server import RedisServer

LIMIT = 8
LIMITS = {"model:m": LimitSpec(max_concurrency=LIMIT)}
GUARD_S = 0.2
"""A short detection interval, so that a test waits seconds, not the default's few more."""


async def replica(url: str, mode: str = "standalone") -> RedisStore:
    store = RedisStore.from_url(url, mode=mode, timeout_s=1.0, guard_interval_s=GUARD_S)  # type: ignore[arg-type]
    await store.start()
    await store.apply_limits(LIMITS)
    return store


async def leases(store: RedisStore, count: int) -> list[Lease]:
    out = [await store.acquire(["model:m"], 0) for _ in range(count)]
    assert all(isinstance(x, Lease) for x in out), out
    return [x for x in out if isinstance(x, Lease)]


async def try_acquire(store: RedisStore) -> Lease | Rejection | None:
    """None: the store refused to decide (unavailable or re-asserting leases)."""
    try:
        return await store.acquire(["model:m"], 0)
    except StoreUnavailable:
        return None


@pytest.fixture(params=["redis", "cluster"])
def target(request: pytest.FixtureRequest) -> tuple[str, str]:
    """(url, mode) of one Redis or of the 3-primary Cluster, flushed."""
    if request.param == "cluster":
        return request.getfixturevalue("cluster_url"), "cluster"
    return request.getfixturevalue("redis_url"), "standalone"


def flush(request: pytest.FixtureRequest, mode: str, url: str) -> None:
    """FLUSHALL on every primary: what a Redis restarted without persistence holds."""
    if mode == "cluster":
        cluster: RedisClusterNodes = request.getfixturevalue("redis_cluster")
        cluster.flush()
    else:
        with redis.Redis.from_url(url) as client:
            client.flushall()


async def test_a_flush_with_leases_held_never_admits_above_the_limit(
    target: tuple[str, str], request: pytest.FixtureRequest
) -> None:
    """A holds half the slots and keeps asking; B holds the other half and is idle (only its guard can
    notice). Neither admits anything after the flush: the leases come back before admissions resume."""
    url, mode = target
    a, b = await replica(url, mode), await replica(url, mode)
    try:
        await leases(a, LIMIT // 2)
        await leases(b, LIMIT // 2)
        flush(request, mode, url)
        admitted, refused_to_decide = 0, 0
        deadline = time.monotonic() + a.recovery_s + 4 * GUARD_S
        while time.monotonic() < deadline:
            result = await try_acquire(a)
            admitted += isinstance(result, Lease)
            refused_to_decide += result is None
            await asyncio.sleep(0.02)
        assert admitted == 0  # before: 8 more, 16 of 8 in flight
        assert refused_to_decide > 0  # the recovery window: the fail mode decided meanwhile
        status = await b.status(["model:m"])
        assert status.remaining_requests == 0  # all 8 counted again
        assert isinstance(await try_acquire(b), Rejection)
        for store in (a, b):
            assert store.health().state_losses == 1
            assert store.health().restored_leases == LIMIT // 2
        metrics = Metrics()
        metrics.watch_store(b.health)
        text = generate_latest(metrics.registry).decode()
        assert "extproc_store_state_losses_total 1.0" in text
        assert "extproc_store_restored_leases_total 4.0" in text
    finally:
        await a.close()
        await b.close()


async def test_lease_keys_evicted_under_a_kept_epoch_are_re_added_at_renewal(redis_url: str) -> None:
    a, b = await replica(redis_url), await replica(redis_url)
    try:
        held = await leases(a, LIMIT)
        with redis.Redis.from_url(redis_url) as client:
            lease_keys = list(client.scan_iter("extproc:{limits}:l:*"))
            assert lease_keys
            client.delete(*lease_keys)  # what `volatile-*` eviction does: keys with a TTL go first
        assert isinstance(await try_acquire(b), Lease)  # the loss is not visible to a decision yet
        assert await a.renew() == LIMIT
        assert a.health().restored_leases == LIMIT and a.health().state_losses == 1
        assert a.lost_leases == 0
        assert (await b.status(["model:m"])).remaining_requests == 0  # 8 of a's and b's one, over by one
        for lease in held:
            assert await a.release(lease, 0)  # settled for real: the re-added leases were the same ones
        assert (await b.status(["model:m"])).remaining_requests == LIMIT - 1
    finally:
        await a.close()
        await b.close()


# -- eviction policy ---------------------------------------------------------------------------------------


@pytest.fixture
def own_server() -> Iterator[RedisServer]:
    server = RedisServer()
    yield server
    server.stop()


@pytest.mark.parametrize("policy", ["volatile-lru", "allkeys-lru", "volatile-ttl"])
async def test_an_evicting_policy_is_refused_until_fixed(
    own_server: RedisServer, policy: str, caplog: pytest.LogCaptureFixture
) -> None:
    own_server.extra = ("--maxmemory", "64mb", "--maxmemory-policy", policy)
    own_server.start()
    store = await replica(own_server.url)
    try:
        health = store.health()
        assert health.eviction == "evicting" and not health.available
        with pytest.raises(StoreUnavailable, match="maxmemory-policy"):
            await store.acquire(["model:m"], 0)
        assert any("maxmemory-policy" in r.getMessage() for r in caplog.records if r.levelno == logging.ERROR)
        with redis.Redis.from_url(own_server.url) as client:
            client.config_set("maxmemory-policy", "noeviction")
        assert isinstance(await admitted_within(store, 10 * GUARD_S), Lease)
        assert store.health().eviction == "safe"
    finally:
        await store.close()


async def test_an_evicting_policy_is_found_on_reconnect(own_server: RedisServer) -> None:
    own_server.start()
    store = await replica(own_server.url)
    try:
        assert isinstance(await try_acquire(store), Lease)
        own_server.kill()
        own_server.extra = ("--maxmemory", "64mb", "--maxmemory-policy", "allkeys-lru")
        own_server.start()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and store.health().eviction != "evicting":
            await try_acquire(store)
            await asyncio.sleep(0.05)
        assert store.health().eviction == "evicting"
        with pytest.raises(StoreUnavailable, match="maxmemory-policy"):
            await store.acquire(["model:m"], 0)
    finally:
        await store.close()


async def test_config_get_refused_is_unverified_and_the_store_runs(
    own_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A managed Redis or an ACL user without `+config`: the store cannot check, says so, and runs."""
    own_server.extra = ("--user", "default", "off")
    own_server.extra += ("--user", "extproc", "on", ">secret", "~extproc:*", "&extproc:*", "+@all", "-config")
    own_server.start()
    url = f"redis://extproc:secret@127.0.0.1:{own_server.port}/0"
    store = await replica(url)
    try:
        assert store.health().eviction == "unverified" and store.health().available
        assert isinstance(await try_acquire(store), Lease)
        assert any(
            "maxmemory-policy" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING
        )
    finally:
        await store.close()


async def test_one_cluster_node_with_an_evicting_policy_is_refused(
    cluster_url: str, redis_cluster: RedisClusterNodes
) -> None:
    """Any node may become the primary of the store's slot, so every node is checked."""
    port = next(p for p in redis_cluster.nodes if p != redis_cluster.primary_of_store())
    with redis_cluster.client(port) as client:
        client.config_set("maxmemory-policy", "allkeys-lru")
    try:
        store = await replica(cluster_url, "cluster")
        try:
            assert store.health().eviction == "evicting"
            with pytest.raises(StoreUnavailable, match="allkeys-lru"):
                await store.acquire(["model:m"], 0)
        finally:
            await store.close()
    finally:
        with redis_cluster.client(port) as client:
            client.config_set("maxmemory-policy", "noeviction")


async def admitted_within(store: RedisStore, seconds: float) -> Lease | Rejection | None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        result = await try_acquire(store)
        if result is not None:
            return result
        await asyncio.sleep(0.05)
    return None
