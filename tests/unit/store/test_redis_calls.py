"""The Redis store's call layer without a server: background work cannot take the connections a request
needs and queues for its own lane outside its bound, and an unavailable call says whether it ever reached
the client (only then may it have run, and only then does it count against Redis)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from extproc.core.limiter.limiter import Lease, Placement
from extproc.core.limiter.state import RateLimitStatus
from extproc.store.redis.breaker import BREAKER_FAILURES, Breaker, RedisUnavailable
from extproc.store.redis.calls import BACKGROUND_SHARE, Background, Calls
from extproc.store.redis.keyspace import Keyspace
from extproc.store.redis.refunds import refund

MAX_IN_FLIGHT = 8


class FakeScript:
    """A registered script whose calls block until `release` is set, counting how many run at once."""

    def __init__(self, text: str, client: FakeClient) -> None:
        self.script = text
        self.sha = ""
        self.client = client

    async def __call__(self, keys: list[str], args: list[str]) -> Any:
        client = self.client
        client.running += 1
        client.high = max(client.high, client.running)
        try:
            if client.block_all or (args and args[0] == "block"):
                await client.release.wait()
            return ["ok"]
        finally:
            client.running -= 1


class FakeClient:
    def __init__(self) -> None:
        self.running = 0
        self.high = 0
        self.release = asyncio.Event()
        self.block_all = False

    def register_script(self, text: str) -> FakeScript:
        return FakeScript(text, self)


def calls_on(client: FakeClient) -> Calls:
    return Calls(client, "extproc:{limits}:", MAX_IN_FLIGHT, Breaker(), Background())  # type: ignore[arg-type]


def background(calls: Calls) -> asyncio.Task[Any]:
    return asyncio.create_task(calls.run(calls.scripts.forget, lambda: ["block"], (), 5.0, fail_fast=False))


def blocking_request(calls: Calls) -> asyncio.Task[Any]:
    return asyncio.create_task(calls.run(calls.scripts.acquire, lambda: ["block"], (), 5.0))


async def test_a_request_is_not_queued_behind_background_work() -> None:
    client = FakeClient()
    calls = calls_on(client)
    backlog = [background(calls) for _ in range(200)]
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert client.running == MAX_IN_FLIGHT // BACKGROUND_SHARE  # the rest wait for a background slot
    assert await calls.run(calls.scripts.acquire, lambda: ["go"], (), 0.05) == ["ok"]
    client.release.set()
    await asyncio.gather(*backlog)
    assert client.high == MAX_IN_FLIGHT // BACKGROUND_SHARE + 1


async def test_requests_alone_may_use_every_connection() -> None:
    client = FakeClient()
    calls = calls_on(client)
    held = [blocking_request(calls) for _ in range(20)]
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert client.running == MAX_IN_FLIGHT
    client.release.set()
    await asyncio.gather(*held)


async def test_failing_fast_sends_nothing() -> None:
    calls = calls_on(FakeClient())
    for _ in range(BREAKER_FAILURES):
        calls.breaker.failed(TimeoutError())
    with pytest.raises(RedisUnavailable) as refused:
        await calls.run(calls.scripts.acquire, lambda: ["go"], (), 0.05)
    assert refused.value.sent is False


async def test_a_bound_spent_waiting_for_a_connection_sent_nothing() -> None:
    client = FakeClient()
    calls = calls_on(client)
    held = [blocking_request(calls) for _ in range(MAX_IN_FLIGHT)]
    await asyncio.sleep(0)
    with pytest.raises(RedisUnavailable) as refused:
        await calls.run(calls.scripts.acquire, lambda: ["go"], (), 0.01)
    assert refused.value.sent is False
    assert calls.breaker.failures == 0  # queueing here is no evidence against Redis
    client.release.set()
    await asyncio.gather(*held)


async def test_background_work_queues_for_its_lane_before_its_bound_starts() -> None:
    client = FakeClient()
    calls = calls_on(client)
    held = [background(calls) for _ in range(MAX_IN_FLIGHT // BACKGROUND_SHARE)]
    await asyncio.sleep(0)
    # A bound of 0 expires at the call's first wait: had the wait for the lane been inside it, this failed.
    queued = asyncio.create_task(calls.run(calls.scripts.forget, lambda: ["go"], (), 0.0, fail_fast=False))
    await asyncio.sleep(0)
    assert not queued.done()
    client.release.set()
    assert await queued == ["ok"]
    await asyncio.gather(*held)
    assert calls.breaker.failures == 0


async def test_a_bound_spent_inside_the_client_may_have_run() -> None:
    calls = calls_on(FakeClient())
    with pytest.raises(RedisUnavailable) as refused:
        await calls.run(calls.scripts.acquire, lambda: ["block"], (), 0.01)
    assert refused.value.sent is True


def open_lease(tokens: int) -> Lease:
    return Lease(1, ("global",), tokens, 0.0, RateLimitStatus(), None, (Placement("global", "s", "s"),))


async def test_a_refund_never_sent_keeps_the_reservation_for_the_release() -> None:
    calls = calls_on(FakeClient())
    for _ in range(BREAKER_FAILURES):
        calls.breaker.failed(TimeoutError())
    lease = open_lease(100)
    assert await refund(calls, Keyspace(), lease, 40, 0.05) is False
    assert lease.reserved_tokens == 100


async def test_a_refund_that_may_have_run_is_taken_as_done() -> None:
    client = FakeClient()
    client.block_all = True
    calls = calls_on(client)
    lease = open_lease(100)
    blocked = asyncio.create_task(refund(calls, Keyspace(), lease, 40, 5.0))
    await asyncio.sleep(0)
    blocked.cancel()  # cancelled while the script may be running in Redis: never refund twice
    with pytest.raises(asyncio.CancelledError):
        await blocked
    assert lease.reserved_tokens == 60
