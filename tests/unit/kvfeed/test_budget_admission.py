"""The KV budget inside a request's admission: concurrent decisions, refusals and departures."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from extproc.admission.exchange import Exchange, Phase, RequestHead
from extproc.admission.replies.verdicts import Forward, Refusal
from extproc.app import Sidecar
from extproc.config import parse_config
from extproc.core.kv_budget import KvBudget
from extproc.core.limiter import Lease, LimitSpec, Rejection
from extproc.metrics import Metrics
from extproc.store.local import LocalStore
from tests.support.servicer import chat

HEAD = RequestHead("POST", "/v1/chat/completions", {})


async def sidecar_with(budget: KvBudget, concurrency: int | None = None) -> tuple[Sidecar, LocalStore]:
    store = LocalStore()
    await store.apply_limits({"global": LimitSpec(max_concurrency=concurrency)})
    sidecar = Sidecar(config=parse_config({}), store=store, metrics=Metrics())
    sidecar.admission.deps.kv_budget = lambda _pool: budget
    return sidecar, store


async def decide(sidecar: Sidecar) -> tuple[Exchange, Forward | Refusal]:
    exchange = Exchange(sidecar.admission)
    exchange.request_headers(HEAD)
    verdicts = [v async for v in exchange.request_body(chat(max_tokens=100))]
    assert len(verdicts) == 1 and isinstance(verdicts[0], Forward | Refusal)
    return exchange, verdicts[0]


async def one_footprint() -> int:
    probe = KvBudget(capacity_tokens=10**6)
    sidecar, _ = await sidecar_with(probe)
    exchange, _ = await decide(sidecar)
    await sidecar.admission.drain()  # a bound admission's exact count lands: the footprint it settles at
    footprint = probe.demand_tokens
    exchange.close()
    await sidecar.admission.drain()
    assert probe.leases == 0
    return footprint


async def test_concurrent_decisions_cannot_both_take_the_last_headroom() -> None:
    """The limiter's acquire awaits: booking after it let every decision in flight pass the same check."""
    footprint = await one_footprint()
    budget = KvBudget(capacity_tokens=footprint * 3 // 2, target_utilization=1.0)
    sidecar, _ = await sidecar_with(budget)
    budget.admit("other", 0, 0)  # the pool is not empty, so nothing is admitted for being first
    results = await asyncio.gather(*(decide(sidecar) for _ in range(4)))
    await sidecar.admission.drain()
    verdicts = [verdict for _, verdict in results]
    assert sum(isinstance(v, Forward) for v in verdicts) == 1
    refused = [v for v in verdicts if isinstance(v, Refusal)]
    assert [r.reason for r in refused] == ["kv_budget"] * 3
    assert budget.leases == 2 and budget.demand_tokens == footprint


async def test_a_limiter_refusal_gives_the_kv_booking_back() -> None:
    budget = KvBudget(capacity_tokens=10**6)
    sidecar, store = await sidecar_with(budget, concurrency=1)
    first, verdict = await decide(sidecar)
    assert isinstance(verdict, Forward)
    second, verdict = await decide(sidecar)
    assert isinstance(verdict, Refusal) and verdict.reason == "concurrency"
    assert second.phase is Phase.REFUSED
    assert budget.leases == 1
    first.close()
    await sidecar.admission.drain()
    assert budget.leases == 0 and store.limiter.snapshot(["global"])[0].active == 0


async def test_a_caller_that_leaves_while_deciding_leaves_no_kv_booking() -> None:
    budget = KvBudget(capacity_tokens=10**6)
    sidecar, store = await sidecar_with(budget)
    gate = asyncio.Event()
    acquire = store.acquire

    async def slow_acquire(
        keys: Sequence[str],
        tokens: int,
        holder: str | None = None,
        use_pool: bool = True,
        output_tokens: int = 0,
    ) -> Lease | Rejection:
        await gate.wait()
        return await acquire(keys, tokens, holder, use_pool, output_tokens)

    store.acquire = slow_acquire  # type: ignore[method-assign]
    task = asyncio.ensure_future(decide(sidecar))
    for _ in range(20):
        await asyncio.sleep(0)
    assert budget.leases == 1  # booked while the limiter is asked
    task.cancel()
    for _ in range(20):
        await asyncio.sleep(0)
    gate.set()
    await asyncio.sleep(0.01)
    await sidecar.admission.drain()
    assert task.cancelled()
    assert budget.leases == 0
    assert store.limiter.snapshot(["global"])[0].active == 0
