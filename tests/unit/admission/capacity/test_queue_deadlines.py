"""Client deadlines and the inference pool's headers through admission, with an injected clock.

A deadline out of reach is refused before the request waits, a margin before it counting as out of reach
(its first token's delay and the slip the forecast has shown); a wait once begun is a promise, ended only
when a grant could no longer bring the first token in time; its own tenant's line is ordered by it; the
queue's bound is the smallest of the global, the class's and the request's. Nothing a refused request took
is kept (slot, tokens, KV booking). Most tests weigh deadlines against the forecast alone (no slip prior,
`Rig(prior=0)`); those about the margin say so.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from extproc.admission.capacity.queueing import FIRST_TOKEN_S, AdmissionQueue
from extproc.admission.exchange import Exchange, RequestHead
from extproc.admission.replies.verdicts import BodyVerdict, Forward, Hold, Refusal
from extproc.core.limiter.limiter import Reason, Rejection
from extproc.core.queue.slip import ForecastSlip
from tests.support.admission import AdmissionRig
from tests.unit.admission.queue_rig import chat, refusal_of, turns

OWN = "x-extproc-ttft-deadline-ms"
LLMD = "x-llm-d-slo-ttft-ms"
CONFIG: dict[str, Any] = {
    "admission": {"tenant": {"header": "x-tenant"}},
    "classes": [
        {"name": "interactive", "queue": {"max_wait_seconds": 10}},
        {"name": "standard", "queue": {"max_wait_seconds": 10}},
        {"name": "batch"},
    ],
    "default_class": "standard",
    "tenants": {"nightly": {"class": "batch"}, "vip": {"class": "interactive"}},
    "models": {"*": {"context_window": 1000, "default_max_tokens": 100}},
}


class Rig(AdmissionRig):
    """Admission with a wait queue over an in-process store of one slot (unless told), on a fake clock;
    `prior`: the slip per second of horizon a promise allows before any was seen (`ForecastSlip.prior`)."""

    def __init__(self, config: dict[str, Any] = CONFIG, slots: int = 1, prior: float = 0.0) -> None:
        super().__init__(config, slots, queues=True)
        self.waits.slip = ForecastSlip(prior=prior)

    @property
    def waits(self) -> AdmissionQueue:
        assert self.queue is not None
        return self.queue

    def exchange(self) -> Exchange:
        exchange = self.admission.exchange()
        self.admission.streams.add(exchange)
        return exchange

    async def hold_the_slot(self, max_tokens: int = 100, tenant: str | None = None) -> Exchange:
        """A request holding the one slot, expected to run max_tokens at the assumed 100 tokens/s."""
        holder = self.exchange()
        verdicts = await self.send(holder, {}, max_tokens, tenant)
        assert isinstance(verdicts[-1], Forward)
        return holder

    async def send(
        self, exchange: Exchange, headers: dict[str, str], max_tokens: int = 10, tenant: str | None = None
    ) -> list[BodyVerdict]:
        head = RequestHead("POST", "/v1/chat/completions", headers, tenant=tenant)
        first = exchange.request_headers(head)
        if isinstance(first, Refusal):
            return [first]
        return [v async for v in exchange.request_body(chat(max_tokens))]

    def waiting(
        self, exchange: Exchange, headers: dict[str, str], tenant: str | None = None, max_tokens: int = 10
    ) -> asyncio.Task[list[BodyVerdict]]:
        return asyncio.ensure_future(self.send(exchange, headers, max_tokens, tenant))

    async def settle(self, exchange: Exchange) -> None:
        exchange.close()
        await self.admission.service.drain()


async def test_a_deadline_shorter_than_the_earliest_free_slot_is_refused_at_once() -> None:
    rig = await Rig().start()
    holder = await rig.hold_the_slot(max_tokens=100)  # frees in about 1 s at the assumed decode rate
    verdicts = await rig.send(rig.exchange(), {OWN: "500"})
    assert not any(isinstance(v, Hold) for v in verdicts), "it must not wait for a slot it cannot get in time"
    refusal = refusal_of(verdicts)
    assert refusal.status == 429 and refusal.reason == "deadline_unmet"
    headers = dict(refusal.all_headers)
    assert headers["x-extproc-reject-reason"] == "deadline_unmet"
    assert int(headers["retry-after"]) >= 1 and "x-should-retry" not in headers
    error = json.loads(refusal.body)["error"]
    assert "deadline could not be met" in error["message"] and error["code"] == "rate_limit_exceeded"
    assert (
        rig.metric(
            "extproc_requests_total",
            decision="rejected",
            reason="deadline_unmet",
            model="other",
            **{"class": "standard"},
        )
        == 1
    )
    assert rig.active == 1  # only the holder's slot
    assert rig.metric("extproc_queue_depth", **{"class": "standard"}) == 0
    await rig.settle(holder)
    assert rig.active == 0


async def test_a_deadline_already_passed_is_refused_at_once() -> None:
    rig = await Rig().start()
    holder = await rig.hold_the_slot()
    refusal = refusal_of(await rig.send(rig.exchange(), {LLMD: "0"}))
    assert refusal.reason == "deadline_unmet"
    await rig.settle(holder)


async def test_a_deadline_within_reach_waits_and_is_admitted_when_the_slot_frees() -> None:
    rig = await Rig().start()
    holder = await rig.hold_the_slot(max_tokens=100)
    task = rig.waiting(rig.exchange(), {OWN: "5000"})
    await turns()
    assert rig.metric("extproc_queue_depth", **{"class": "standard"}) == 1
    rig.clock.advance(1.0)
    await rig.settle(holder)
    await turns()
    verdicts = await task
    assert isinstance(verdicts[0], Hold) and verdicts[0].seconds == 6  # ceil(5 s) + 1: its deadline, not 10 s
    assert isinstance(verdicts[-1], Forward)


async def test_a_wait_ends_when_a_grant_could_no_longer_meet_the_deadline() -> None:
    rig = await Rig().start()
    holder = await rig.hold_the_slot(max_tokens=100)
    task = rig.waiting(rig.exchange(), {OWN: "2000"})
    await turns()
    rig.clock.advance(2.0 - FIRST_TOKEN_S - 0.01)  # a grant now still brings the first token in time
    rig.waits.kick()
    await turns()
    assert not task.done()
    rig.clock.advance(0.01)  # from here its first token would come after the deadline
    rig.waits.kick()
    await turns()
    refusal = refusal_of(await task)
    assert refusal.reason == "deadline_unmet"
    assert rig.metric("extproc_queue_wait_seconds_count", outcome="deadline", **{"class": "standard"}) == 1
    assert rig.metric("extproc_queue_depth", **{"class": "standard"}) == 0
    assert rig.active == 1
    await rig.settle(holder)
    assert rig.active == 0


async def test_a_newcomer_never_pushes_a_waiter_in_time_out_of_its_deadline() -> None:
    rig = await Rig(slots=2).start()
    short, long = await rig.hold_the_slot(max_tokens=100), await rig.hold_the_slot(max_tokens=300)  # 1 s, 3 s
    waiting = rig.exchange()
    later = rig.waiting(waiting, {OWN: "2500"})  # the first slot to free (1 s) is in time
    await turns()
    # In time itself (1 s), but going first (a nearer deadline) for 3 s would make `later` wait 3 s: refused.
    refusal = refusal_of(await rig.send(rig.exchange(), {OWN: "2000"}, max_tokens=300))
    assert refusal.reason == "deadline_unmet"
    # A short one fits in before it: admitted at 1 s, `later` at 1.1 s.
    quick_exchange = rig.exchange()
    quick = rig.waiting(quick_exchange, {OWN: "2000"})
    await turns()
    assert not quick.done() and not later.done()
    for exchange in (short, quick_exchange, long, waiting):
        await rig.settle(exchange)
        await turns()
    assert isinstance((await quick)[-1], Forward) and isinstance((await later)[-1], Forward)
    assert rig.active == 0


async def test_a_promised_waiter_the_layout_turns_late_keeps_its_place_and_is_admitted_in_time() -> None:
    rig = await Rig(slots=2).start()
    short, long = await rig.hold_the_slot(max_tokens=100), await rig.hold_the_slot(max_tokens=300)  # 1 s, 3 s
    waiting = rig.exchange()
    later = rig.waiting(waiting, {OWN: "2500"})  # the first slot to free (1 s) is in time
    await turns()
    # A higher class goes first whatever the deadlines below it, to hold the first slot to free for 3 s.
    vip_exchange = rig.exchange()
    vip = rig.waiting(vip_exchange, {}, tenant="vip", max_tokens=300)
    await turns()
    rig.waits.kick()
    await turns()
    # Behind it, `later` is laid out at 3 s, past its 2.5 s; but it was promised: it is not refused on that.
    assert not later.done() and not vip.done()
    rig.clock.advance(1.0)
    await rig.settle(short)
    await turns()
    assert isinstance((await vip)[-1], Forward) and not later.done()
    rig.clock.advance(0.5)
    await rig.settle(long)  # the long answer ended early: its slot frees in time for `later`
    await turns()
    assert isinstance((await later)[-1], Forward)
    assert rig.metric("extproc_queue_wait_seconds_count", outcome="admitted", **{"class": "standard"}) == 1
    for exchange in (vip_exchange, waiting):
        await rig.settle(exchange)
    assert rig.active == 0


async def test_a_promised_waiter_whose_slot_never_frees_in_time_is_refused_when_no_grant_could_help() -> None:
    rig = await Rig(slots=2).start()
    short, long = await rig.hold_the_slot(max_tokens=100), await rig.hold_the_slot(max_tokens=300)
    later = rig.waiting(rig.exchange(), {OWN: "2500"})
    await turns()
    vip_exchange = rig.exchange()
    vip = rig.waiting(vip_exchange, {}, tenant="vip", max_tokens=300)
    await turns()
    rig.clock.advance(1.0)
    await rig.settle(short)  # the vip takes the slot `later` was promised
    await turns()
    assert isinstance((await vip)[-1], Forward)
    rig.clock.advance(1.5 - FIRST_TOKEN_S - 0.01)
    rig.waits.kick()
    await turns()
    assert not later.done()
    rig.clock.advance(0.01)
    rig.waits.kick()
    await turns()
    refusal = refusal_of(await later)
    assert refusal.reason == "deadline_unmet" and "retry-after" in dict(refusal.all_headers)
    assert rig.metric("extproc_queue_wait_seconds_count", outcome="deadline", **{"class": "standard"}) == 1
    for exchange in (long, vip_exchange):
        await rig.settle(exchange)
    assert rig.active == 0


async def test_a_lean_request_that_ended_at_the_proxy_frees_its_slot_in_the_layout_at_once() -> None:
    rig = await Rig().start()
    service = rig.admission.service
    holder = rig.admission.exchange(reported=True)  # lean: its end comes in a report
    rig.admission.streams.add(holder)
    verdicts = await rig.send(holder, {}, max_tokens=100)
    assert isinstance(verdicts[-1], Forward)
    status = await rig.store.status(["global"])
    slot = Rejection(reason=Reason.CONCURRENCY, key="global", retry_after_s=1.0, status=status)
    assert service.capacity_starts(slot, [0.0], []) == pytest.approx([1.0])  # 100 tokens to go
    # The HTTP request ended (its ext_proc stream closed, no longer open here), the report on its way.
    holder.stream_ended()
    rig.admission.streams.discard(holder)
    rig.clock.advance(0.06)  # past the 50 ms the open leases are read for
    assert service.capacity_starts(slot, [0.0], []) == pytest.approx([0.05])
    await service.drain()


async def test_another_tenants_own_limit_says_nothing_of_a_deadline() -> None:
    rig = await Rig(slots=2).start(busy=1)
    busy = await rig.hold_the_slot(max_tokens=300, tenant="busy")  # its own one slot, for about 3 s
    behind, calm = rig.exchange(), rig.exchange()
    busy_waits = rig.waiting(behind, {}, tenant="busy")  # refused by tenant:busy, it waits
    await turns()
    quick = rig.waiting(calm, {OWN: "500"}, tenant="calm")  # behind it in the class, but not in its way
    await turns()
    rig.waits.kick()
    await turns()
    assert isinstance((await quick)[-1], Forward), "busy's own limit must not refuse calm's deadline"
    assert not busy_waits.done()
    for exchange in (busy, calm):
        await rig.settle(exchange)
    await turns()
    assert isinstance((await busy_waits)[-1], Forward)
    await rig.settle(behind)
    assert rig.active == 0


async def test_a_newcomer_is_weighed_behind_the_runs_of_those_expected_to_go_first() -> None:
    rig = await Rig().start()
    holder = await rig.hold_the_slot(max_tokens=100)  # frees in 1 s
    first = rig.exchange()
    ahead = rig.waiting(first, {OWN: "1500"}, max_tokens=200)  # goes first, then holds it for 2 s
    await turns()
    # A deadline of 2.5 s would be met by the first slot to free (1 s), not behind `ahead` (3 s): refused.
    refusal = refusal_of(await rig.send(rig.exchange(), {OWN: "2500"}))
    assert refusal.reason == "deadline_unmet"
    assert int(dict(refusal.all_headers)["retry-after"]) == 3
    # With 3.5 s it waits (behind `ahead`, whose deadline is nearer).
    patient = rig.exchange()
    waits = rig.waiting(patient, {OWN: "3500"})
    await turns()
    assert not waits.done()
    for exchange in (holder, first, patient):
        await rig.settle(exchange)
        await turns()
    assert isinstance((await ahead)[-1], Forward) and isinstance((await waits)[-1], Forward)
    assert rig.active == 0


async def test_the_global_bound_caps_every_class_wait_and_times_out_as_the_queue_does() -> None:
    rig = await Rig({**CONFIG, "admission": {**CONFIG["admission"], "max_queue_wait_seconds": 3}}).start()
    holder = await rig.hold_the_slot()
    task = rig.waiting(rig.exchange(), {OWN: "8000"})
    await turns()
    rig.clock.advance(3.0)
    rig.waits.kick()
    await turns()
    verdicts = await task
    assert isinstance(verdicts[0], Hold) and verdicts[0].seconds == 4
    assert refusal_of(verdicts).reason == "queue_timeout"  # the global bound ended it, not the deadline
    await rig.settle(holder)


async def test_within_a_tenant_the_nearest_deadline_goes_first() -> None:
    rig = await Rig().start()
    holder = await rig.hold_the_slot(max_tokens=10)
    plain_exchange, urgent_exchange = rig.exchange(), rig.exchange()
    plain = rig.waiting(plain_exchange, {})
    await turns()
    urgent = rig.waiting(urgent_exchange, {OWN: "9000"})
    await turns()
    await rig.settle(holder)
    await turns()
    assert urgent.done() and isinstance((await urgent)[-1], Forward)
    assert not plain.done(), "the request without a deadline waits behind the one with a deadline"
    await rig.settle(urgent_exchange)
    await turns()
    assert isinstance((await plain)[-1], Forward)
    await rig.settle(plain_exchange)
    assert rig.active == 0


async def test_a_bad_own_header_is_a_400_naming_it_and_holds_nothing() -> None:
    rig = await Rig().start()
    refusal = refusal_of(await rig.send(rig.exchange(), {OWN: "-3"}))
    assert refusal.status == 400
    assert json.loads(refusal.body)["error"]["param"] == OWN
    assert rig.active == 0
    assert (
        rig.metric(
            "extproc_requests_total",
            decision="rejected",
            reason="invalid_value",
            model="unknown",
            **{"class": "standard"},
        )
        == 1
    )


async def test_a_bad_llmd_header_is_ignored_as_llmd_ignores_it() -> None:
    rig = await Rig().start()
    exchange = rig.exchange()
    verdicts = await rig.send(exchange, {LLMD: "soon"})
    assert isinstance(verdicts[-1], Forward)
    assert exchange.request is not None and exchange.request.deadline is None
    await rig.settle(exchange)


POOL: dict[str, Any] = {
    **CONFIG,
    "admission": {
        "tenant": {"header": "x-tenant"},
        "inference_pool": {
            "trust_fairness_id": True,
            "trust_objective": True,
            "objectives": {"chat-latency": "interactive"},
        },
    },
}


def facts(rig: Rig, headers: dict[str, str], verified: str | None = None) -> tuple[str, str]:
    """The tenant and class of a request; `verified`: the claim of the trusted tenant source."""
    exchange = rig.exchange()
    exchange.request_headers(RequestHead("POST", "/v1/chat/completions", headers, tenant=verified))
    assert exchange.request is not None
    return exchange.request.tenant, exchange.request.klass.name


async def test_trusted_inference_pool_headers_name_tenant_and_class() -> None:
    rig = Rig(POOL)
    assert facts(rig, {"x-gateway-inference-fairness-id": "team-a"}) == ("team-a", "standard")
    assert (
        facts(rig, {"x-llm-d-inference-fairness-id": "b", "x-gateway-inference-fairness-id": "a"})[0] == "b"
    )
    assert facts(rig, {"x-gateway-inference-objective": "chat-latency"})[1] == "interactive"  # mapped
    assert facts(rig, {"x-gateway-inference-objective": "batch"})[1] == "batch"  # a class of its name
    assert facts(rig, {"x-gateway-inference-objective": "unknown"})[1] == "standard"  # the tenant's
    # The verified tenant source wins over the fairness id; an objective overrides the tenant's class.
    pool_id = {"x-gateway-inference-fairness-id": "team-a"}
    assert facts(rig, pool_id, verified="nightly") == ("nightly", "batch")
    objective = {**pool_id, "x-llm-d-inference-objective": "chat-latency"}
    assert facts(rig, objective, verified="nightly") == ("nightly", "interactive")
    assert facts(rig, {"x-gateway-inference-fairness-id": "not a tenant id!"})[0] == "default"


async def test_untrusted_inference_pool_headers_are_ignored() -> None:
    rig = Rig()
    headers = {"x-gateway-inference-fairness-id": "team-a", "x-gateway-inference-objective": "interactive"}
    assert facts(rig, headers) == ("default", "standard")


async def test_a_promise_keeps_the_prior_margin_until_the_forecast_was_checked() -> None:
    rig = await Rig(prior=1.0).start()
    holder = await rig.hold_the_slot(max_tokens=100)  # frees in 1 s
    # In time by the forecast (1 s + the first token's delay), not by a second's slip per second: refused.
    assert refusal_of(await rig.send(rig.exchange(), {OWN: "2000"})).reason == "deadline_unmet"
    patient = rig.exchange()
    waits = rig.waiting(patient, {OWN: str(round((1.0 + FIRST_TOKEN_S + 1.0) * 1000) + 10)})
    await turns()
    assert not waits.done()
    rig.clock.advance(1.0)
    await rig.settle(holder)
    await turns()
    assert isinstance((await waits)[-1], Forward)
    await rig.settle(patient)


async def test_the_margin_is_learned_from_how_late_grants_came_against_their_forecast() -> None:
    rig = await Rig().start()
    rig.waits.slip = ForecastSlip(prior=0.0, min_samples=1)
    holder = await rig.hold_the_slot(max_tokens=100)  # forecast to free in 1 s
    first = rig.exchange()
    ahead = rig.waiting(first, {OWN: "9000"})
    await turns()
    rig.waits.kick()  # a pump lays the line out: `ahead` expected in 1 s
    await turns()
    rig.clock.advance(1.5)  # the holder ran half a second past its forecast
    await rig.settle(holder)
    await turns()
    assert isinstance((await ahead)[-1], Forward)
    assert rig.waits.slip.rate() == pytest.approx(0.5)  # 0.5 s late over a 1 s horizon
    # Now a start 0.1 s away (the 10-token `ahead`) is promised only 0.05 s + 0.5 x 0.5 s (the floor) early.
    assert refusal_of(await rig.send(rig.exchange(), {OWN: "390"})).reason == "deadline_unmet"
    patient = rig.exchange()
    waits = rig.waiting(patient, {OWN: "410"})
    await turns()
    assert not waits.done()
    for exchange in (first, patient):
        rig.clock.advance(0.1)
        await rig.settle(exchange)
        await turns()
    assert isinstance((await waits)[-1], Forward)


@pytest.mark.parametrize(("prior", "pushed"), [(0.0, False), (0.25, True)])
async def test_a_newcomer_may_not_push_a_promised_waiter_into_its_margin(prior: float, pushed: bool) -> None:
    rig = await Rig(slots=2, prior=prior).start()
    short, long = await rig.hold_the_slot(max_tokens=100), await rig.hold_the_slot(max_tokens=300)  # 1 s, 3 s
    waiting = rig.exchange()
    later = rig.waiting(waiting, {OWN: "2500"})  # expected at 1 s
    await turns()
    # Going first at 1 s for 1 s moves `later` to 2 s: 0.45 s before its deadline, in time with the first
    # token's delay alone, inside a margin of 0.05 s + 0.25 x 2 s.
    quick_exchange = rig.exchange()
    quick = rig.waiting(quick_exchange, {OWN: "2000"}, max_tokens=100)
    await turns()
    if pushed:
        assert quick.done() and refusal_of(await quick).reason == "deadline_unmet"
    else:
        assert not quick.done()
    assert not later.done()
    for exchange in (short, long, quick_exchange, waiting):
        rig.clock.advance(1.0)
        await rig.settle(exchange)
        await turns()
    assert isinstance((await later)[-1], Forward)
    assert rig.active == 0


async def test_a_newcomer_placed_ahead_moves_the_forecast_it_is_judged_against() -> None:
    rig = await Rig().start()
    rig.waits.slip = ForecastSlip(prior=0.0, min_samples=1)
    holder = await rig.hold_the_slot(max_tokens=100)  # frees in 1 s
    first = rig.exchange()
    patient = rig.waiting(first, {OWN: "9000"}, max_tokens=100)
    await turns()
    rig.waits.kick()  # laid out: `patient` at 1 s
    await turns()
    second = rig.exchange()
    urgent = rig.waiting(second, {OWN: "3000"}, max_tokens=100)  # ahead of it, 1 s: `patient` moves to 2 s
    await turns()
    rig.waits.kick()
    await turns()
    for exchange, task in ((holder, urgent), (second, patient)):
        rig.clock.advance(1.0)
        await rig.settle(exchange)
        await turns()
        assert isinstance((await task)[-1], Forward)
    # Both came when laid out: the second later than first foreseen, but for the newcomer, not a slip.
    assert rig.waits.slip.rate() == 0.0
    await rig.settle(first)
    assert rig.active == 0
