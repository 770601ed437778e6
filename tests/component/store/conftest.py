"""Fixtures of the store tests: one real redis-server per module and one 3-primary Redis Cluster per session,
flushed before each test."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest
import redis

from extproc.store.redis import RedisStore
from tests.component.store.redis_cluster import RedisClusterNodes
from tests.component.store.redis_server import RedisServer
from tests.support.store_harness import Harness, local_harness


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer()
    server.start()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    with redis.Redis.from_url(redis_server.url) as client:
        client.flushall()
    return redis_server.url


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[RedisClusterNodes]:
    """Three primaries, no replicas: what the store's behaviour needs (failover tests start their own)."""
    cluster = RedisClusterNodes(primaries=3)
    cluster.start()
    yield cluster
    cluster.stop()


@pytest.fixture
def cluster_url(redis_cluster: RedisClusterNodes) -> str:
    redis_cluster.flush()
    return redis_cluster.url


async def harness(request: pytest.FixtureRequest, kind: str) -> AsyncIterator[Harness]:
    """A harness over the in-process store (fake clock), one Redis or a Redis Cluster, closed after."""
    if kind == "local":
        yield local_harness()
        return
    if kind == "cluster":
        store = RedisStore.from_url(request.getfixturevalue("cluster_url"), mode="cluster", timeout_s=1.0)
    else:
        store = RedisStore.from_url(request.getfixturevalue("redis_url"), timeout_s=1.0)
    await store.start()
    try:
        yield Harness(store)
    finally:
        await store.close()


@pytest.fixture(params=["local", "redis", "cluster"])
async def h(request: pytest.FixtureRequest) -> AsyncIterator[Harness]:
    """The same test against the in-process store, one Redis and a Redis Cluster."""
    async for opened in harness(request, request.param):
        yield opened


@pytest.fixture(params=["redis", "cluster"])
async def redis_h(request: pytest.FixtureRequest) -> AsyncIterator[Harness]:
    """The Redis stores only: for cases tests/unit already runs on the in-process store."""
    async for opened in harness(request, request.param):
        yield opened
