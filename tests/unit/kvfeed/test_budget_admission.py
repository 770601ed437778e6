"""The KV budget inside a request's admission: concurrent decisions, refusals and departures."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from extproc.admission.exchange import Exchange, Phase, RequestHead
from extproc.admission.replies.verdicts import Forward, Hold, Refusal
from extproc.app import Sidecar
from extproc.config import parse_config
from extproc.core.kv.budget import KvBudget
from extproc.core.limiter.limiter import Lease, LimitSpec, Rejection
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


QUEUED = {"classes": [{"name": "standard", "queue": {"max_wait_seconds": 20}}], "default_class": "standard"}


async def queued_sidecar(budget: KvBudget, config: dict[str, Any] = QUEUED) -> tuple[Sidecar, LocalStore]:
    """A sidecar whose one class may wait in its queue, with `budget` as every pool's KV budget."""
    store = LocalStore()
    sidecar = Sidecar(config=parse_config(config), store=store, metrics=Metrics())
    await sidecar.apply_config(sidecar.config)
    sidecar.admission.deps.kv_budget = lambda _pool: budget
    return sidecar, store


async def test_a_class_that_queues_waits_for_kv_instead_of_being_sent_away() -> None:
    """The KV budget refuses the second request now; its class may queue, so it waits there (Hold) and is
    admitted, booked, the moment the first one's KV is released: no refusal, no retry-after to guess."""
    footprint = await one_footprint()
    budget = KvBudget(capacity_tokens=footprint * 3 // 2, target_utilization=1.0)
    sidecar, _ = await queued_sidecar(budget)
    first, verdict = await decide(sidecar)
    assert isinstance(verdict, Forward)
    second = Exchange(sidecar.admission)
    second.request_headers(HEAD)
    steps = second.request_body(chat(max_tokens=100))
    hold = await anext(steps)
    assert isinstance(hold, Hold)  # waiting: Envoy's message timer is extended
    assert budget.leases == 1  # nothing booked for the waiter yet
    waiting = asyncio.ensure_future(anext(steps))
    for _ in range(20):
        await asyncio.sleep(0)
    assert not waiting.done()
    first.close()
    await sidecar.admission.drain()
    admitted = await asyncio.wait_for(waiting, 5)
    assert isinstance(admitted, Forward)
    assert budget.leases == 1 and second.phase is Phase.ADMITTED
    second.close()
    await sidecar.admission.drain()
    assert budget.leases == 0


async def test_a_kv_wait_that_runs_out_gets_the_kv_refusal_and_books_nothing() -> None:
    footprint = await one_footprint()
    budget = KvBudget(capacity_tokens=footprint * 3 // 2, target_utilization=1.0)
    config = {**QUEUED, "classes": [{"name": "standard", "queue": {"max_wait_seconds": 0.2}}]}
    sidecar, store = await queued_sidecar(budget, config)
    first, verdict = await decide_queued(sidecar)
    assert isinstance(verdict, Forward)
    _, verdict = await decide_queued(sidecar)
    assert isinstance(verdict, Refusal) and verdict.reason == "kv_budget"
    assert budget.leases == 1
    first.close()
    await sidecar.admission.drain()
    assert budget.leases == 0 and store.limiter.snapshot(["global"])[0].active == 0


async def decide_queued(sidecar: Sidecar) -> tuple[Exchange, Forward | Refusal]:
    """`decide` for a class that may queue: its `Hold` first, then the verdict."""
    exchange = Exchange(sidecar.admission)
    exchange.request_headers(HEAD)
    verdicts = [v async for v in exchange.request_body(chat(max_tokens=100))]
    final = verdicts[-1]
    assert isinstance(final, Forward | Refusal)
    return exchange, final


async def test_a_request_queued_behind_a_kv_waiter_holds_no_kv_while_it_waits() -> None:
    """A small request that fits lines up behind a waiter of its class: booked while it waits, it would take
    the KV the waiter ahead needs, and neither would move until one timed out."""
    footprint = await one_footprint()
    budget = KvBudget(capacity_tokens=footprint * 5 // 2, target_utilization=1.0)
    sidecar, _ = await queued_sidecar(budget)
    first, verdict = await decide(sidecar)
    assert isinstance(verdict, Forward)
    second, verdict = await decide(sidecar)
    assert isinstance(verdict, Forward)  # two fit, a third does not
    waiters = []
    for _ in range(2):
        exchange = Exchange(sidecar.admission)
        exchange.request_headers(HEAD)
        steps = exchange.request_body(chat(max_tokens=100))
        assert isinstance(await anext(steps), Hold)
        waiters.append((exchange, asyncio.ensure_future(anext(steps))))
    for _ in range(20):
        await asyncio.sleep(0)
    assert budget.leases == 2  # the two admitted; the waiters book nothing
    first.close()
    second.close()
    await sidecar.admission.drain()
    for exchange, step in waiters:
        assert isinstance(await asyncio.wait_for(step, 5), Forward)
        exchange.close()
    await sidecar.admission.drain()
    assert budget.leases == 0


async def test_a_model_named_without_limits_is_bounded_by_the_kv_budget_alone() -> None:
    """docs/configuration.md, `limits`: a model entry may be only its name; with no slot or TPM limit on any
    key it applies to, what bounds it is the KV budget (booked KV up to target_utilization of the capacity
    the feed reports), refusing with `kv_budget` and a retry hint, not the limiter."""
    footprint = await one_footprint()
    store = LocalStore()
    config = parse_config({"models": {"m": {}}})
    assert config.limits.models == {} and config.limits.global_ == LimitSpec()
    await store.apply_limits(config.limit_specs()[0])
    sidecar = Sidecar(config=config, store=store, metrics=Metrics())
    budget = KvBudget(capacity_tokens=footprint * 5 // 2, target_utilization=1.0)
    sidecar.admission.deps.kv_budget = lambda _pool: budget
    budget.admit("other", 0, 0)  # the pool is not empty, so nothing is admitted for being first
    results = [await decide(sidecar) for _ in range(4)]
    await sidecar.admission.drain()
    verdicts = [verdict for _, verdict in results]
    assert [isinstance(v, Forward) for v in verdicts] == [True, True, False, False]
    refused = [v for v in verdicts if isinstance(v, Refusal)]
    assert [r.reason for r in refused] == ["kv_budget"] * 2
    assert all(r.status == 429 and "retry-after" in dict(r.headers) for r in refused)
