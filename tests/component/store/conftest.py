"""Fixtures of the store tests: one real redis-server per module, flushed before each test."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest
import redis

from extproc.core.clock import FakeClock
from extproc.store.local import LocalStore
from extproc.store.redis import RedisStore
from tests.component.store.harness import Harness
from tests.component.store.redis_server import RedisServer


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


@pytest.fixture(params=["local", "redis"])
async def h(request: pytest.FixtureRequest) -> AsyncIterator[Harness]:
    """The same test against both stores."""
    if request.param == "local":
        clock = FakeClock()
        yield Harness(LocalStore(clock=clock), clock)
        return
    url = request.getfixturevalue("redis_url")
    store = RedisStore.from_url(url, timeout_s=1.0)
    await store.start()
    try:
        yield Harness(store)
    finally:
        await store.close()
