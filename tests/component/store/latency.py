"""Acquire/release latency of the Redis store here: `python -m tests.component.store.latency`.

Starts its own redis-server. Three keys per request (global, model, tenant) with a class guarantee, as the
sidecar sends them. Sequential (one call outstanding) and with 16 concurrent callers.
"""

from __future__ import annotations

import asyncio
import statistics
import time

from extproc.core.limiter.limiter import Lease, LimitSpec
from extproc.store.redis import RedisStore
from tests.component.store.redis_server import RedisServer

SPECS = {
    "global": LimitSpec(max_concurrency=10_000, tokens_per_minute=10**12),
    "model:m": LimitSpec(
        max_concurrency=5_000,
        tokens_per_minute=10**12,
        guaranteed=(("critical", LimitSpec(max_concurrency=1000, tokens_per_minute=10**11)),),
    ),
}
DEFAULTS = {"tenant:": LimitSpec(max_concurrency=100, tokens_per_minute=10**9)}


def pct(values: list[float], p: float) -> float:
    return sorted(values)[min(len(values) - 1, int(len(values) * p))] * 1000


async def sequential(store: RedisStore, n: int) -> tuple[list[float], list[float]]:
    acq: list[float] = []
    rel: list[float] = []
    for i in range(n):
        t0 = time.perf_counter()
        lease = await store.acquire(["global", "model:m", f"tenant:t{i % 64}"], 500, "critical")
        t1 = time.perf_counter()
        assert isinstance(lease, Lease)
        await store.release(lease, 300)
        t2 = time.perf_counter()
        acq.append(t1 - t0)
        rel.append(t2 - t1)
    return acq, rel


async def concurrent(store: RedisStore, n: int, callers: int) -> tuple[list[float], float]:
    acq: list[float] = []

    async def caller(k: int) -> None:
        for i in range(n // callers):
            t0 = time.perf_counter()
            lease = await store.acquire(["global", "model:m", f"tenant:t{(i + k) % 64}"], 500, "critical")
            acq.append(time.perf_counter() - t0)
            assert isinstance(lease, Lease)
            await store.release(lease, 300)

    t0 = time.perf_counter()
    await asyncio.gather(*(caller(k) for k in range(callers)))
    return acq, (2 * len(acq)) / (time.perf_counter() - t0)


async def main() -> None:
    server = RedisServer()
    server.start()
    try:
        store = RedisStore.from_url(server.url)
        await store.start()
        await store.apply_limits(SPECS, DEFAULTS, ("critical",))
        await sequential(store, 1000)  # warm-up
        for run in range(3):
            acq, rel = await sequential(store, 5000)
            print(
                f"run {run}: sequential acquire p50 {pct(acq, 0.5):.3f} ms p99 {pct(acq, 0.99):.3f} ms; "
                f"release p50 {pct(rel, 0.5):.3f} ms p99 {pct(rel, 0.99):.3f} ms; "
                f"mean acquire {statistics.mean(acq) * 1000:.3f} ms"
            )
            cacq, rate = await concurrent(store, 8000, 16)
            print(
                f"run {run}: 16 callers acquire p50 {pct(cacq, 0.5):.3f} ms p99 {pct(cacq, 0.99):.3f} ms; "
                f"{rate:,.0f} calls/s (acquire + release)"
            )
        await store.close()
    finally:
        server.stop()


if __name__ == "__main__":
    asyncio.run(main())
