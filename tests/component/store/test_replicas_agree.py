"""Replicas agree: one effective scale for all (the minimum of fresh proposals), no decision at an old scale
once a new one is stored, dead replicas' proposals age out, and a release wakes another replica's waiters."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from extproc.admission.capacity import queueing
from extproc.admission.capacity.queueing import AdmissionQueue
from extproc.core.limiter.limiter import Lease, LimitSpec
from extproc.metrics import Metrics
from extproc.store.redis import RedisStore
from extproc.store.redis import scales as redis_scales
from tests.support.waiting import until

LIMITS = {"model:m": LimitSpec(max_concurrency=100), "global": LimitSpec(max_concurrency=1)}


async def replica(url: str, mode: str) -> RedisStore:
    store = RedisStore.from_url(url, mode="cluster" if mode == "cluster" else "standalone", timeout_s=1.0)
    await store.start()
    await store.apply_limits(LIMITS)
    return store


@pytest.fixture(params=["redis", "cluster"])
async def pair(request: pytest.FixtureRequest) -> AsyncIterator[tuple[RedisStore, RedisStore]]:
    url = request.getfixturevalue("cluster_url" if request.param == "cluster" else "redis_url")
    a, b = await replica(url, request.param), await replica(url, request.param)
    yield a, b
    await a.close()
    await b.close()


async def limit_seen_by(store: RedisStore) -> int | None:
    lease = await store.acquire(["model:m"], 0)
    assert isinstance(lease, Lease)
    await store.release(lease, 0)
    return lease.status.limit_requests


async def test_the_lowest_fresh_proposal_is_every_replicas_scale(pair: tuple[RedisStore, RedisStore]) -> None:
    a, b = pair
    await a.set_scale("model:m", 0.5)
    assert await limit_seen_by(b) == 50  # b proposed nothing, and still admits at a's scale
    await b.set_scale("model:m", 0.8)
    assert (await limit_seen_by(a), await limit_seen_by(b)) == (50, 50)
    await a.set_scale("model:m", 1.0)  # a's feed recovered: b's proposal is now the lowest
    assert (await limit_seen_by(a), await limit_seen_by(b)) == (80, 80)
    await b.set_scale("model:m", 1.0)
    assert (await limit_seen_by(a), await limit_seen_by(b)) == (100, 100)
    assert a.effective_scale("model:m") == b.effective_scale("model:m") == 1.0


async def test_no_decision_at_the_old_scale_after_the_new_one_is_stored(
    pair: tuple[RedisStore, RedisStore],
) -> None:
    """Decisions ordered by Redis server time: every one at the old limit precedes every one at the new."""
    a, b = pair
    decisions: list[tuple[float, int | None]] = []
    stop = asyncio.Event()

    async def admit(store: RedisStore) -> None:
        while not stop.is_set():
            lease = await store.acquire(["model:m"], 0)
            assert isinstance(lease, Lease)
            decisions.append((lease.acquired_at, lease.status.limit_requests))
            await store.release(lease, 0)

    workers = [asyncio.create_task(admit(s)) for s in (a, b, a, b)]
    await asyncio.sleep(0.1)
    await a.set_scale("model:m", 0.5)  # b's feed has not caught up: it never proposes
    await asyncio.sleep(0.2)
    stop.set()
    await asyncio.gather(*workers)
    old = [t for t, limit in decisions if limit == 100]
    new = [t for t, limit in decisions if limit == 50]
    assert old and new and len(old) + len(new) == len(decisions)
    assert max(old) < min(new)
    assert b.stale_retries > 0  # b learnt the new scale from a refused call, not from its own feed


async def test_a_dead_replicas_proposal_ages_out(
    pair: tuple[RedisStore, RedisStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(redis_scales, "SCALE_PROPOSAL_TTL_S", 0.5)
    a, b = pair
    await a.set_scale("model:m", 0.5)
    await a.close()  # a dies holding the limits low
    assert await limit_seen_by(b) == 50
    await asyncio.sleep(0.6)
    await b.set_scale("model:m", 1.0)  # any proposal (a periodic one too) drops expired ones
    assert await limit_seen_by(b) == 100


async def test_a_release_wakes_a_waiter_on_another_replica(
    pair: tuple[RedisStore, RedisStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the queue's own tick at 30 s, only the wake-up can admit the waiter in time. The release comes
    once the waiter's first try has been refused: a try still in flight at the release (a loaded CI host, the
    cluster's round trips) admitted it with no wake-up at all."""
    monkeypatch.setattr(queueing, "PUMP_INTERVAL_S", 30.0)
    a, b = pair
    queue = AdmissionQueue(b, time.monotonic, Metrics())
    queue.configure(("c",), {"c": 10})
    b.on_wake(queue.kick)
    held = await a.acquire(["global"], 0)
    assert isinstance(held, Lease)
    refused: list[object] = []
    acquire = b.acquire

    async def tried(*args: Any, **kwargs: Any) -> Any:
        result = await acquire(*args, **kwargs)
        refused.extend([result] if not isinstance(result, Lease) else [])
        return result

    monkeypatch.setattr(b, "acquire", tried)
    waiter = asyncio.create_task(queue.wait(["global"], 0, "c", "t", 10.0))
    await until(lambda: bool(refused), 10.0)  # its first try refused: it waits
    await asyncio.sleep(0.3)  # and is announced
    assert refused and not waiter.done()
    t0 = time.monotonic()
    await a.release(held, 0)
    lease = await asyncio.wait_for(waiter, 5.0)
    assert isinstance(lease, Lease)
    assert time.monotonic() - t0 < 2.0 and b.wakeups > 0
    await b.release(lease, 0)
    queue.close()


async def test_no_wake_up_is_published_while_nobody_waits(pair: tuple[RedisStore, RedisStore]) -> None:
    a, b = pair
    b.on_wake(lambda: None)
    await asyncio.sleep(0.2)
    for _ in range(20):
        lease = await a.acquire(["global"], 0)
        assert isinstance(lease, Lease)
        await a.release(lease, 0)
    await asyncio.sleep(0.2)
    assert b.wakeups == 0
