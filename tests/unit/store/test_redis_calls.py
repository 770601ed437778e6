"""The Redis store's call layer without a server: background work cannot take the connections a request
needs, and an unavailable call says whether it ever reached the client (only then may it have run)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from extproc.store.redis.breaker import BREAKER_FAILURES, Breaker, RedisUnavailable
from extproc.store.redis.calls import BACKGROUND_SHARE, Background, Calls

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
            if args and args[0] == "block":
                await client.release.wait()
            return ["ok"]
        finally:
            client.running -= 1


class FakeClient:
    def __init__(self) -> None:
        self.running = 0
        self.high = 0
        self.release = asyncio.Event()

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
    client.release.set()
    await asyncio.gather(*held)


async def test_a_bound_spent_inside_the_client_may_have_run() -> None:
    calls = calls_on(FakeClient())
    with pytest.raises(RedisUnavailable) as refused:
        await calls.run(calls.scripts.acquire, lambda: ["block"], (), 0.01)
    assert refused.value.sent is True
