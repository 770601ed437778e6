"""Two sidecar replicas sharing one Redis: one global limit, and what happens when Redis goes away."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from extproc.app import Sidecar
from extproc.config import parse_config
from extproc.metrics import Metrics
from extproc.store.fallback import FallbackStore, share_of
from extproc.store.redis import BREAKER_OPEN_S, RedisStore
from tests.component.store.redis_server import RedisServer
from tests.support.servicer import Harness, body_msg, chat, header_map, headers_msg
from tests.support.waiting import eventually


def config(url: str, **store: Any) -> dict[str, Any]:
    return {
        "server": {"grpc_listen": "127.0.0.1:0", "admin_listen": "127.0.0.1:0"},
        "store": {"backend": "redis", "redis": {"url": url, "timeout_ms": 100}, **store},
        "limits": {"global": {"max_concurrency": 2, "tokens_per_minute": 100_000}},
    }


async def replica(cfg: dict[str, Any]) -> Harness:
    sidecar = Sidecar(config=parse_config(cfg), metrics=Metrics())
    await sidecar.start()
    return Harness(sidecar, grpc.aio.insecure_channel(f"127.0.0.1:{sidecar.grpc_port}"))


@pytest.fixture
async def replicas(redis_url: str) -> AsyncIterator[tuple[Harness, Harness]]:
    a, b = (
        await replica(config(redis_url, fallback_share=0.5)),
        await replica(config(redis_url, fallback_share=0.5)),
    )
    try:
        yield a, b
    finally:
        for h in (a, b):
            await h.sidecar.stop(grace_s=0)


async def admit(h: Harness) -> tuple[Any, Any]:
    s = h.stream()
    await s.send(headers_msg("POST", "/v1/chat/completions"))
    return s, await s.send(body_msg(chat(max_tokens=10)))


async def test_replicas_share_one_limit(replicas: tuple[Harness, Harness]) -> None:
    a, b = replicas
    assert isinstance(a.sidecar.store, FallbackStore) and isinstance(a.sidecar.store.primary, RedisStore)
    s1, r1 = await admit(a)
    s2, r2 = await admit(b)
    assert r1.HasField("request_body") and r2.HasField("request_body")
    s3, r3 = await admit(a)
    assert r3.immediate_response.status.code == 429  # the other replica holds the second slot
    s3.cancel()
    s2.cancel()  # a slot frees on replica b ...
    await eventually(lambda: b.metric("extproc_active_requests") == 0)
    await b.sidecar.admission.drain()
    s4, r4 = await admit(a)  # ... and replica a can use it
    assert r4.HasField("request_body")
    for s in (s1, s4):
        s.cancel()


async def test_redis_down_falls_back_to_each_replicas_share(
    redis_server: RedisServer, redis_url: str
) -> None:
    h = await replica(config(redis_url, fallback_share=0.5))
    try:
        redis_server.pause()
        try:
            s1, r1 = await admit(h)  # one slot: half of the global 2
            assert r1.HasField("request_body")
            s2, r2 = await admit(h)
            assert r2.immediate_response.status.code == 429
            store = h.sidecar.store
            assert isinstance(store, FallbackStore) and store.degraded
        finally:
            redis_server.resume()
        s1.cancel()
        s2.cancel()
        await eventually(lambda: h.metric("extproc_active_requests") == 0)
    finally:
        await h.sidecar.stop(grace_s=0)


async def test_redis_down_fails_closed_when_configured(redis_server: RedisServer, redis_url: str) -> None:
    h = await replica(config(redis_url, on_unavailable="reject"))
    try:
        redis_server.pause()
        try:
            s, reply = await admit(h)
        finally:
            redis_server.resume()
        assert reply.immediate_response.status.code == 503
        headers = header_map(reply.immediate_response.headers)
        assert headers["x-extproc-reject-reason"] == "store_unavailable"
        assert int(headers["retry-after"]) >= 1
        assert json.loads(reply.immediate_response.body)["error"]["code"] == "service_unavailable"
        s.cancel()
    finally:
        await h.sidecar.stop(grace_s=0)


def test_fallback_share_cuts_every_limit_and_guarantee() -> None:
    from extproc.core.limiter.limiter import LimitSpec

    spec = LimitSpec(
        max_concurrency=10,
        tokens_per_minute=1000,
        guaranteed=(("a", LimitSpec(max_concurrency=4, tokens_per_minute=400)),),
    )
    half = share_of(spec, 0.5)
    assert (half.max_concurrency, half.tokens_per_minute) == (5, 500)
    assert half.guarantees()["a"] == LimitSpec(max_concurrency=2, tokens_per_minute=200)
    assert share_of(LimitSpec(max_concurrency=1), 0.25).max_concurrency == 1  # never to zero
    assert share_of(LimitSpec(max_concurrency=0), 0.5).max_concurrency == 0


async def test_fallback_counts_the_shared_leases_this_replica_runs(
    redis_server: RedisServer, redis_url: str
) -> None:
    """Redis away: a replica's share covers what it already runs, not only what it admits from now on."""
    from extproc.core.limiter.limiter import Lease, LimitSpec, Rejection
    from extproc.store.local import LocalStore

    store = FallbackStore(RedisStore.from_url(redis_url, timeout_s=0.1), LocalStore(), 0.5)
    await store.start()
    await store.apply_limits({"global": LimitSpec(max_concurrency=4)})
    try:
        running = await store.acquire(["global"], 0)
        assert isinstance(running, Lease) and not store.degraded
        redis_server.pause()
        try:
            local = await store.acquire(["global"], 0)  # share: 2 slots, one taken by the running lease
            assert isinstance(local, Lease) and store.degraded
            assert isinstance(await store.acquire(["global"], 0), Rejection)
            await store.release(running, 0)  # its shadow frees a local slot
            again = await store.acquire(["global"], 0)
            assert isinstance(again, Lease)
        finally:
            redis_server.resume()
        for lease in (local, again):
            assert await store.release(lease, 0)
        assert store.fallback.snapshot()[0].active == 0  # no shadow left behind
    finally:
        await store.close()


async def test_back_from_fallback_its_leases_are_adopted_and_every_replica_counts_them(
    redis_server: RedisServer, redis_url: str
) -> None:
    """Leases taken in the fallback are not in Redis: once it answers again they are placed there (their
    requests run), so another replica admits beside them no more than the limit leaves, and they settle
    there. Without the adoption the other replica took all 4 slots beside the 2 running: 6 on a limit of 4
    (the engine tier's fleet saw it as one request more on the engine than Redis held, for 5 s)."""
    from extproc.core.limiter.limiter import Lease, LimitSpec, Rejection
    from extproc.store.local import LocalStore

    spec = {"global": LimitSpec(max_concurrency=4, tokens_per_minute=10_000)}
    a, b = (FallbackStore(RedisStore.from_url(redis_url, timeout_s=0.1), LocalStore(), 0.5) for _ in "ab")
    for store in (a, b):
        await store.start()
        await store.apply_limits(spec)
    try:
        redis_server.pause()
        try:
            taken = [await a.acquire(["global"], 1_000) for _ in range(2)]  # a's whole share, locally
        finally:
            redis_server.resume()
        assert all(isinstance(lease, Lease) for lease in taken) and a.degraded
        await asyncio.sleep(BREAKER_OPEN_S + 0.1)
        assert isinstance(await a.acquire(["global"], 0), Rejection)  # its share still runs the two
        await eventually(lambda: a.adoptions == 2)
        before = await b.primary.status(["global"])
        assert before.remaining_requests == 2
        beside = [await b.acquire(["global"], 0) for _ in range(3)]
        assert [isinstance(lease, Lease) for lease in beside] == [True, True, False]
        for lease in taken:
            assert isinstance(lease, Lease)
            assert await a.release(lease, 100)  # settled in Redis: 900 of its 1,000 back
        after = await b.primary.status(["global"])
        assert after.remaining_requests == 4 - 2
        assert after.remaining_tokens is not None and before.remaining_tokens is not None
        assert after.remaining_tokens >= before.remaining_tokens + 1_800
        for lease in beside[:2]:
            assert isinstance(lease, Lease)
            await b.release(lease, 0)
        assert a.fallback.snapshot()[0].active == 0  # no shadow left behind
        assert isinstance(await a.acquire(["global"], 0), Lease)  # fallback leases ended: shared again
    finally:
        for store in (a, b):
            await store.close()
