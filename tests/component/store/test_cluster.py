"""Redis Cluster: a primary killed under load, a replica promoted; the configured fail mode holds meanwhile,
no counter goes negative and nothing leaks once leases settle.

The cluster (3 primaries, 3 replicas, `cluster-node-timeout` 1 s) is started by the test. Two store replicas
run 16 clients that take a slot on `global` (8 slots), hold it a few ms and release it, while the primary of
the store's slot is SIGKILLed. The figures are printed (`pytest -s`) and written to `docs/store.md`.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import TypeVar

import pytest

from extproc.core.limiter.limiter import Lease, LimitSpec, Rejection
from extproc.core.ports import LimiterStore, StoreUnavailable
from extproc.store.fallback import FallbackStore
from extproc.store.local import LocalStore
from extproc.store.redis import RedisStore
from tests.component.store.redis_cluster import RedisClusterNodes
from tests.support.waiting import until

LIMIT = 8
LIMITS = {"global": LimitSpec(max_concurrency=LIMIT, tokens_per_minute=6_000_000)}
SHARE = 0.5
TIMEOUT_S = 0.1
T = TypeVar("T")


@pytest.fixture
def cluster() -> Iterator[RedisClusterNodes]:
    nodes = RedisClusterNodes(primaries=3, replicas=1)
    nodes.start()
    yield nodes
    nodes.stop()


@dataclass
class Load:
    """What the clients saw, by where their lease came from."""

    fallback: bool
    shared_in_flight: int = 0
    shared_high: int = 0
    local_in_flight: dict[int, int] = field(default_factory=dict)
    local_high: int = 0
    admitted_shared: int = 0
    admitted_local: int = 0
    unavailable_at: list[float] = field(default_factory=list)
    """When each call that ran out of its bound ended."""
    slowest_s: float = 0.0
    first_gap: float | None = None
    last_gap: float | None = None

    @property
    def unavailable(self) -> int:
        return len(self.unavailable_at)

    def windows_unavailable(self) -> int:
        """The 100 ms windows in which some call ran out of its bound: one stall of the host times out every
        call in flight at once (up to the 16 clients), so the calls' count says little and the time does."""
        return len({int(t / TIMEOUT_S) for t in self.unavailable_at})

    def gap(self, now: float) -> None:
        self.first_gap = now if self.first_gap is None else self.first_gap
        self.last_gap = now


async def client(store: LimiterStore, index: int, load: Load, stop: asyncio.Event) -> None:
    while not stop.is_set():
        t0 = time.monotonic()
        try:
            result = await store.acquire(["global"], 10)
        except StoreUnavailable:
            now = time.monotonic()
            load.unavailable_at.append(now)
            load.gap(now)
            load.slowest_s = max(load.slowest_s, time.monotonic() - t0)
            await asyncio.sleep(0.01)
            continue
        load.slowest_s = max(load.slowest_s, time.monotonic() - t0)
        if isinstance(result, Rejection):
            await asyncio.sleep(0.002)
            continue
        local = isinstance(store, FallbackStore) and id(result) in store._local
        await hold(store, index, result, local, load)


async def hold(store: LimiterStore, index: int, lease: Lease, local: bool, load: Load) -> None:
    if local:
        load.gap(time.monotonic())
        load.admitted_local += 1
        load.local_in_flight[index] = load.local_in_flight.get(index, 0) + 1
        load.local_high = max(load.local_high, load.local_in_flight[index])
    else:
        load.admitted_shared += 1
        load.shared_in_flight += 1
        load.shared_high = max(load.shared_high, load.shared_in_flight)
    await asyncio.sleep(random.uniform(0.002, 0.01))
    if local:
        load.local_in_flight[index] -= 1
    else:
        load.shared_in_flight -= 1
    await store.release(lease, 10)


async def answered(call: Callable[[], Awaitable[T]], misses: list[str], seconds: float = 5.0) -> T:
    """The first answer of a store call within `seconds`, each miss noted in `misses`. A call is bounded by
    the 100 ms timeout, which a starved machine can exceed once in a while with the store working as
    designed (unavailable, not hung); more than a few misses means the store is not answering requests
    (as when a backlog of background calls held every connection after the failover)."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            return await call()
        except StoreUnavailable as exc:
            misses.append(str(exc))
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.05)


def leases_left(cluster: RedisClusterNodes) -> int:
    with cluster.client(cluster.primary_of_store()) as c:
        return sum(int(c.zcard(k)) for k in c.keys("extproc:{limits}:l:*"))


@pytest.mark.parametrize("on_unavailable", ["local", "reject"])
async def test_primary_killed_under_load(cluster: RedisClusterNodes, on_unavailable: str) -> None:
    shared = [RedisStore.from_url(cluster.url, mode="cluster", timeout_s=TIMEOUT_S) for _ in range(2)]
    stores: list[LimiterStore] = []
    for store in shared:
        await store.start()
        front: LimiterStore = store
        if on_unavailable == "local":
            front = FallbackStore(store, LocalStore(), SHARE)
        await front.apply_limits(LIMITS)
        stores.append(front)
    wakes = [0]
    shared[0].on_wake(lambda: wakes.__setitem__(0, wakes[0] + 1))
    load = Load(fallback=on_unavailable == "local")
    stop = asyncio.Event()
    tasks = [asyncio.create_task(client(stores[i % 2], i % 2, load, stop)) for i in range(16)]
    try:
        await until(lambda: load.admitted_shared > 50, 5)
        before = load.admitted_shared
        # A call slower than the 100 ms timeout is unavailable; on a starved machine some may be, before any
        # fault, all at once when the host stalls (a clean-clone run: 10 calls). Unavailable in more than a
        # few 100 ms windows means the store itself misbehaves.
        unavailable_before = load.unavailable
        stalled = load.windows_unavailable()
        assert before > 50 and stalled <= 5, f"{unavailable_before} calls unavailable in {stalled} windows"
        killed_at = time.monotonic()
        cluster.kill(cluster.primary_of_store())
        await asyncio.to_thread(cluster.wait_ok)
        promoted_at = time.monotonic()
        resumed = load.admitted_shared
        await until(lambda: load.admitted_shared >= resumed + 100, 10)
    finally:
        stop.set()
        await asyncio.gather(*tasks)

    # Leases whose release failed during the gap are released by the background retries, acquires whose
    # reply was lost are forgotten: wait for all of it, then nothing may be left.
    await until(lambda: leases_left(cluster) == 0, 20)
    left = leases_left(cluster)
    misses: list[str] = []
    status = await answered(lambda: shared[0].status(["global"]), misses)

    # The wake-up subscription found the new primary: a release there reaches the other replica.
    shared[0].announce_waiting()
    await asyncio.sleep(0.2)
    seen = wakes[0]
    lease = await answered(lambda: shared[1].acquire(["global"], 0), misses)
    assert isinstance(lease, Lease)
    await shared[1].release(lease, 0)
    await until(lambda: wakes[0] > seen, 5)
    for store in shared:
        await store.close()

    gap = (load.last_gap - load.first_gap) if load.first_gap and load.last_gap else 0.0
    print(
        f"\n[{on_unavailable}] failover {promoted_at - killed_at:.2f} s after the kill; "
        f"store unanswered for {gap:.2f} s; unavailable {load.unavailable}, fallback admissions "
        f"{load.admitted_local}, shared admissions {load.admitted_shared}; high water shared "
        f"{load.shared_high}/{LIMIT}, local {load.local_high}/{int(LIMIT * SHARE)} per replica; slowest call "
        f"{load.slowest_s * 1000:.0f} ms; leases left {left}; lost {sum(s.lost_leases for s in shared)}, "
        f"dropped releases {sum(s.dropped_releases for s in shared)}"
    )
    assert load.admitted_shared > resumed + 50, "the store did not come back after the failover"
    assert load.slowest_s < 1.0, "a call hung past 1 s, a fifth of Envoy's message timeout"
    assert load.shared_high <= LIMIT
    if on_unavailable == "local":
        assert load.unavailable == 0 and load.admitted_local > 0
        assert load.local_high <= int(LIMIT * SHARE)  # each replica kept to its share meanwhile
    else:
        assert load.unavailable > unavailable_before and load.admitted_local == 0
    assert left == 0, "leases leaked"
    assert status.remaining_requests == LIMIT  # no slot lost, none counted twice, no negative count
    assert status.remaining_tokens is not None and status.remaining_tokens <= 6_000_000
    assert wakes[0] > seen, "the wake-up subscription did not reconnect"
    assert len(misses) <= 3, f"the store kept refusing after the failover: {misses}"
