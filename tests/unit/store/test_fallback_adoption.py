"""The local fallback's way back (extproc/store/fallback.py): leases taken while the shared store could not
answer are adopted into it once it answers, and every way a lease can end while or after it is adopted
leaves nothing held in either store. The shared store here is an in-process one that can be made to fail and
whose adoptions can be held in flight; tests/component/store/test_sidecar_shared.py does the same against a
real Redis and a second replica."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from extproc.core.limiter.limiter import Lease, LimitSpec, Rejection
from extproc.core.ports import StoreUnavailable
from extproc.store import fallback
from extproc.store.fallback import FallbackStore
from extproc.store.local import LocalStore

LIMITS = {"m": LimitSpec(max_concurrency=4)}


class Shared(LocalStore):
    """A shared store that answers only while `up`, and whose adoptions wait for `adoptions` to be set."""

    def __init__(self) -> None:
        super().__init__()
        self.up = True
        self.adoptions = asyncio.Event()
        self.adoptions.set()

    async def acquire(
        self,
        keys: Sequence[str],
        tokens: int,
        holder: str | None = None,
        use_pool: bool = True,
        output_tokens: int = 0,
    ) -> Lease | Rejection:
        if not self.up:
            raise StoreUnavailable("down")
        return await super().acquire(keys, tokens, holder, use_pool, output_tokens)

    async def adopt(self, lease: Lease) -> Lease:
        await self.adoptions.wait()
        if not self.up:
            raise StoreUnavailable("down")
        placed = await super().acquire(lease.keys, lease.reserved_tokens, lease.holder)
        assert isinstance(placed, Lease)
        return placed


def active(store: LocalStore) -> int:
    return sum(snap.active for snap in store.snapshot())


async def fallen_back(shared: Shared) -> tuple[FallbackStore, Lease]:
    """A front store with one lease taken in its fallback while `shared` was down, `shared` up again."""
    store = FallbackStore(shared, LocalStore(), 0.5)
    await store.apply_limits(LIMITS)
    shared.up = False
    local = await store.acquire(["m"], 0)
    assert isinstance(local, Lease) and store.degraded
    shared.up = True
    return store, local


async def settle_adoption() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_an_adopted_lease_is_held_in_the_shared_store_and_settled_there() -> None:
    shared = Shared()
    store, local = await fallen_back(shared)
    assert active(shared) == 0
    assert isinstance(await store.acquire(["m"], 0), Lease)
    await settle_adoption()
    assert store.adoptions == 1 and active(shared) == 2
    await store.release(local, 0)
    assert active(shared) == 1 and active(store.fallback) == 1  # the other lease's shadow only


async def test_a_lease_settled_while_its_adoption_is_in_flight_leaves_nothing_held() -> None:
    shared = Shared()
    store, local = await fallen_back(shared)
    shared.adoptions.clear()
    second = await store.acquire(["m"], 0)
    assert isinstance(second, Lease)
    await settle_adoption()
    await store.release(local, 0)  # ends in the fallback, its adoption still waiting
    shared.adoptions.set()
    await settle_adoption()
    assert store.adoptions == 0 and active(shared) == 1  # only `second`
    await store.release(second, 0)
    assert active(shared) == 0 and active(store.fallback) == 0


async def test_a_slot_given_back_before_the_adoption_is_given_back_in_the_shared_store_too() -> None:
    shared = Shared()
    store, local = await fallen_back(shared)
    assert await store.release_slot(local)
    assert isinstance(await store.acquire(["m"], 0), Lease)
    await settle_adoption()
    assert store.adoptions == 1 and active(shared) == 1  # the new lease; the adopted one holds no slot
    await store.release(local, 0)
    assert active(store.fallback) == 1  # the new lease's shadow


async def test_an_adoption_that_fails_is_tried_again_until_it_lands(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fallback, "ADOPT_RETRY_S", 0.0)
    shared = Shared()
    store, local = await fallen_back(shared)
    shared.adoptions.clear()
    assert isinstance(await store.acquire(["m"], 0), Lease)
    shared.up = False
    shared.adoptions.set()
    await settle_adoption()
    assert store.adoptions == 0  # failed: still local
    shared.up = True
    await settle_adoption()
    assert store.adoptions == 1
    await store.release(local, 0)
