"""`LimiterStore.refund`: part of an open lease's reservation given back early (a bound admission corrected
to its exact count), the same in the in-process store, one Redis and a Redis Cluster; the release after it
stays exact."""

from __future__ import annotations

from extproc.core.limiter import Lease, LimitSpec, Rejection
from tests.component.store.harness import Harness

TPM = 6000


async def test_a_refund_frees_tokens_now_and_the_release_stays_exact(h: Harness) -> None:
    await h.apply({"m": LimitSpec(max_concurrency=2, tokens_per_minute=TPM)})
    lease = await h.lease(["m"], 5000)
    assert isinstance(await h.acquire(["m"], 4000), Rejection)
    assert await h.store.refund(lease, 4000) is True
    assert lease.reserved_tokens == 1000
    second = await h.lease(["m"], 4000)  # what the refund gave back
    assert await h.store.release(second, 0)
    assert await h.store.release(lease, 300)
    status = await h.store.status(["m"])
    assert status.remaining_tokens is not None
    assert status.remaining_tokens == h.tokens(TPM - 300, TPM)
    assert status.remaining_requests == 2


async def test_a_settled_lease_takes_no_refund(h: Harness) -> None:
    await h.apply({"m": LimitSpec(tokens_per_minute=TPM)})
    lease = await h.lease(["m"], 1000)
    assert await h.store.release(lease, 1000)
    assert await h.store.refund(lease, 500) is False
    status = await h.store.status(["m"])
    assert status.remaining_tokens == h.tokens(TPM - 1000, TPM)


async def test_a_refund_never_lifts_a_bucket_above_capacity_nor_exceeds_the_reservation(h: Harness) -> None:
    await h.apply({"m": LimitSpec(tokens_per_minute=TPM), "n": LimitSpec(tokens_per_minute=TPM)})
    lease: Lease = await h.lease(["m", "n"], 100)
    assert await h.store.refund(lease, 10_000)
    assert lease.reserved_tokens == 0
    for key in ("m", "n"):
        assert (await h.store.status([key])).remaining_tokens == h.tokens(TPM, TPM)
    assert await h.store.release(lease, 0)
    assert (await h.store.status(["m"])).remaining_tokens == h.tokens(TPM, TPM)
