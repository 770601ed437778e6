"""How long two replicas disagree, and how fast a release wakes another replica's waiter:
`python -m tests.component.store.replicas [--rounds N] [--skew S]`.

Starts its own redis-server; two `RedisStore` replicas in this process (one clock for both).

Disagreement window: both replicas admit on `model:m` (1000 slots) in a loop while the adaptive scale
moves between 1 and 0.5. Replica A learns the new scale from its feed at T, replica B `--skew` seconds later
(the feed reaches replicas at different times). Every admission records the Redis server time it was
judged at (`Lease.acquired_at`) and the limit it was judged against (`Lease.status.limit_requests`). The
window of one change is the time from the first decision at the new limit to the last decision at the old
one (0 when they never overlap).

Wake-up latency: A holds the only slot of `global`, B has a request waiting in its `AdmissionQueue`; the
time from A's release to B's waiter being admitted. Without wake-ups it is bounded by the queue's 100 ms
tick.

Uses only what the store offered before the shared scale and the wake-ups existed, so the same script
measures the code before them (run it from a checkout of that commit).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

from extproc.admission.capacity.queueing import AdmissionQueue
from extproc.core.limiter.limiter import Lease, LimitSpec
from extproc.metrics import Metrics
from extproc.store.redis import RedisStore
from tests.component.store.redis_server import RedisServer

LIMITS = {"model:m": LimitSpec(max_concurrency=1000), "global": LimitSpec(max_concurrency=1)}


def pct(values: list[float], p: float) -> float:
    return sorted(values)[min(len(values) - 1, int(len(values) * p))]


async def disagreement(a: RedisStore, b: RedisStore, skew_s: float, rounds: int) -> list[float]:
    decisions: list[tuple[float, int]] = []
    stop = asyncio.Event()

    async def admit(store: RedisStore) -> None:
        while not stop.is_set():
            lease = await store.acquire(["model:m"], 0)
            assert isinstance(lease, Lease)
            decisions.append((lease.acquired_at, lease.status.limit_requests or 0))
            await store.release(lease, 0)

    workers = [asyncio.create_task(admit(s)) for s in (a, b, a, b)]
    windows: list[float] = []
    scale = 1.0
    for _ in range(rounds):
        await asyncio.sleep(0.3)
        old = 1000 if scale == 1.0 else 500
        scale = 0.5 if scale == 1.0 else 1.0
        new = 1000 if scale == 1.0 else 500
        decisions.clear()
        await a.set_scale("model:m", scale)
        await asyncio.sleep(skew_s)
        await b.set_scale("model:m", scale)
        await asyncio.sleep(0.3)
        first_new = min(t for t, limit in decisions if limit == new)
        last_old = max((t for t, limit in decisions if limit == old), default=0.0)
        windows.append(max(0.0, last_old - first_new))
    stop.set()
    await asyncio.gather(*workers)
    return windows


async def wake_latency(a: RedisStore, b: RedisStore, rounds: int) -> list[float]:
    queue = AdmissionQueue(b, time.monotonic, Metrics())
    queue.configure(("c",), {"c": 10})
    on_wake: Any = getattr(b, "on_wake", None)
    if on_wake is not None:
        on_wake(queue.kick)
        await asyncio.sleep(0.2)
    latencies: list[float] = []
    for _ in range(rounds):
        held = await a.acquire(["global"], 0)
        assert isinstance(held, Lease)
        waiter = asyncio.create_task(queue.wait(["global"], 0, "c", "t", 5.0))
        await asyncio.sleep(0.15)  # queued, announced, and a tick or two gone by
        t0 = time.perf_counter()
        await a.release(held, 0)
        lease = await waiter
        latencies.append(time.perf_counter() - t0)
        assert isinstance(lease, Lease)
        await b.release(lease, 0)
    queue.close()
    return latencies


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--skew", type=float, default=0.2)
    args = parser.parse_args()
    server = RedisServer()
    server.start()
    try:
        a, b = RedisStore.from_url(server.url, timeout_s=1.0), RedisStore.from_url(server.url, timeout_s=1.0)
        for store in (a, b):
            await store.start()
            await store.apply_limits(LIMITS)
        windows = await disagreement(a, b, args.skew, args.rounds)
        print(
            f"disagreement window, feed skew {args.skew * 1000:.0f} ms, {len(windows)} scale changes: "
            f"max {max(windows) * 1000:.1f} ms, mean {sum(windows) / len(windows) * 1000:.1f} ms"
        )
        latencies = await wake_latency(a, b, args.rounds * 10)
        print(
            f"wake-up latency (release on A -> waiter on B admitted), {len(latencies)} rounds: "
            f"p50 {pct(latencies, 0.5) * 1000:.1f} ms, p99 {pct(latencies, 0.99) * 1000:.1f} ms"
        )
        for store in (a, b):
            await store.close()
    finally:
        server.stop()


if __name__ == "__main__":
    asyncio.run(main())
