"""`LimiterStore.refund`: part of an open lease's reservation given back early (a bound admission corrected
to its exact count), the same in the in-process store, one Redis and a Redis Cluster; the release after it
stays exact."""

from __future__ import annotations

import json

import pytest

from extproc.admission.deciding.provisional import Stage
from extproc.admission.exchange import Exchange, RequestHead
from extproc.admission.replies.verdicts import Forward
from extproc.app import Sidecar
from extproc.config import parse_config
from extproc.core.limiter.limiter import Lease, LimitSpec, Rejection
from extproc.metrics import Metrics
from tests.support.store_harness import Harness

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


async def test_a_bound_admission_on_redis_gives_the_difference_back_while_it_runs(redis_url: str) -> None:
    """The sidecar on a shared store: admitted on the byte bound, the bucket in Redis holds the exact need
    once the count lands, and the release leaves the ledger exact."""
    config = parse_config(
        {
            "store": {"backend": "redis", "redis": {"url": redis_url, "timeout_ms": 500}},
            "limits": {"global": {"tokens_per_minute": TPM * 10}},
        }
    )
    sidecar = Sidecar(config=config, metrics=Metrics())
    assert sidecar.store is not None
    await sidecar.store.start()
    await sidecar.apply_config(config)
    try:
        exchange = Exchange(sidecar.admission)
        exchange.request_headers(RequestHead("POST", "/v1/chat/completions", {}))
        raw = json.dumps(
            {"model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": "word " * 200}]}
        ).encode()
        verdicts = [v async for v in exchange.request_body(raw)]
        assert isinstance(verdicts[-1], Forward)
        correction, admitted = exchange.correction, exchange.admitted
        assert correction is not None and admitted is not None
        bound = admitted.plan.total
        assert correction.task is not None
        await correction.task
        assert correction.stage is Stage.CORRECTED and correction.refunded > 0
        exact = exchange.admitted.plan.total  # type: ignore[union-attr]
        assert bound - correction.refunded == exact == admitted.lease.reserved_tokens
        status = await sidecar.store.status(["global"])
        assert status.remaining_tokens == pytest.approx(TPM * 10 - exact, abs=TPM * 10 / 60)
        exchange.close()
        await sidecar.admission.drain()
        registry = sidecar.metrics.registry

        def value(name: str, **labels: str) -> float:
            return registry.get_sample_value(name, {"model": "other", **labels}) or 0.0

        settled = value("extproc_tokens_settled_total", kind="prompt") + value(
            "extproc_tokens_settled_total", kind="completion"
        )
        reserved, refunded = value("extproc_tokens_reserved_total"), value("extproc_tokens_refunded_total")
        assert reserved == bound and reserved - refunded + value("extproc_tokens_overrun_total") == settled
    finally:
        await sidecar.store.close()
