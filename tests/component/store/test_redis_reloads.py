"""A reload of the Redis store touches only the keys whose limits change, a batch of keys per script call.

It used to store and resize every configured key in one script call: with 10^5 tenants that call outlived
its timeout (Redis was left at the old capacities) and building and parsing it held the event loop for
seconds, even when the file had not changed at all.
"""

from __future__ import annotations

import pytest

from extproc.core.limiter.limiter import Lease, LimitSpec, Rejection
from extproc.store.redis import RedisStore
from extproc.store.redis.views import SYNC_BATCH_KEYS

DEFAULTS = {"tenant:": LimitSpec(max_concurrency=8, tokens_per_minute=600)}


def tenants(count: int, **changed: LimitSpec) -> dict[str, LimitSpec]:
    specs = {"global": LimitSpec(max_concurrency=1000)}
    specs |= {f"tenant:t{i}": LimitSpec(max_concurrency=2, tokens_per_minute=1200) for i in range(count)}
    return specs | {f"tenant:{name}": spec for name, spec in changed.items()}


async def test_a_reload_syncs_only_changed_keys_in_batches(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = RedisStore.from_url(redis_url)
    await store.start()
    calls: list[tuple[str, int]] = []
    read = store.views.read

    async def counted(keys: list[str], mode: str, background: bool) -> object:
        if mode != "0":
            calls.append((mode, len(keys)))
        return await read(keys, mode, background)

    monkeypatch.setattr(store.views, "read", counted)
    try:
        await store.apply_limits(tenants(1000), DEFAULTS)
        assert calls and max(n for _, n in calls) <= SYNC_BATCH_KEYS
        assert sum(n for mode, n in calls if mode == "resize") == 1001

        calls.clear()
        await store.apply_limits(tenants(1000), DEFAULTS)  # the same file again
        assert calls == []

        held = await store.acquire(["tenant:t7"], 0)
        assert isinstance(held, Lease)
        calls.clear()
        await store.apply_limits(tenants(1000, t7=LimitSpec(max_concurrency=1)), DEFAULTS)
        assert calls == [("fill", 1), ("resize", 1)]
        assert isinstance(await store.acquire(["tenant:t7"], 0), Rejection)  # the new limit, lease kept
        assert isinstance(await store.acquire(["tenant:t8"], 0), Lease)
        assert await store.release(held, 0)
    finally:
        await store.close()


async def test_the_metrics_cache_stays_bounded_with_many_tenants_in_use(redis_url: str) -> None:
    store = RedisStore.from_url(redis_url)
    await store.start()
    try:
        await store.apply_limits(tenants(1500), DEFAULTS)
        for i in range(1000, 1300):
            assert isinstance(await store.acquire([f"tenant:t{i}"], 0), Lease)
        keys = [snap.key for snap in store.snapshot()]
        assert keys[:2] == ["global", "tenant:t0"]  # the first configured keys, for their gauges
        assert len(keys) == 1000 + 100  # and the 100 busiest of the others
    finally:
        await store.close()
