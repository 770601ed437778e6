"""An engine outage named as such (issue 41): a pool the KV feed shows with no live endpoint is refused up
front with a retryable 503 of its own (`engine_down`), and a request admitted just before, which Envoy then
failed to connect for, settles as `engine_unreachable`, refunded in full, its slot and KV booking back; a
later filter's refusal (an endpoint picker) stays `not_forwarded`."""

from __future__ import annotations

import json
from typing import Any

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import struct_pb2

from extproc.admission.exchange import Exchange
from extproc.admission.replies.verdicts import Forward, Refusal
from extproc.admission.tracking.reading import ResponseReading
from extproc.core.kv.budget import KvBudget
from extproc.protocol.messages import EXT_PROC_ATTRIBUTES, engine_unreachable, upstream_reset
from tests.unit.admission.exchange_rig import CONFIG, Rig, chat


class DownRig(Rig):
    """Admission whose pool `*` the feed shows down for `down_for` seconds (None: up), with a KV budget."""

    def __init__(self, config: dict[str, Any] = CONFIG) -> None:
        super().__init__(config)
        self.down_for: float | None = None
        self.budget = KvBudget(100_000)
        deps = self.admission.service.deps
        deps.engine_down_for = lambda _pool: self.down_for
        deps.kv_budget = lambda _pool: self.budget

    def refusals(self, decision: str) -> float:
        """Requests counted `engine_down` under `decision` (the model label `other`: `*`'s pool)."""
        labels = {"decision": decision, "reason": "engine_down", "model": "other", "class": "standard"}
        return self.metric("extproc_requests_total", **labels)

    def leaked(self) -> list[str]:
        """What an ended request still holds: a slot, tokens not settled, KV booked."""
        held = []
        if self.active:
            held.append("slot")
        reserved = self.total("extproc_tokens_reserved_total")
        settled = self.total("extproc_tokens_settled_total")
        if reserved - self.total("extproc_tokens_refunded_total") != settled:
            held.append("tokens")
        if self.budget.demand_tokens:
            held.append("kv")
        return held


def error_of(refusal: Refusal) -> dict[str, Any]:
    error: dict[str, Any] = json.loads(refusal.body)["error"]
    return error


async def test_a_pool_with_no_live_endpoint_is_refused_up_front_with_its_own_503() -> None:
    rig = await DownRig().start()
    rig.down_for = 12.0
    verdict = await rig.decide(rig.admission.exchange(), chat())
    assert isinstance(verdict, Refusal)
    headers = dict(verdict.headers)
    assert verdict.status == 503 and verdict.reason == "engine_down"
    assert headers["x-extproc-reject-reason"] == "engine_down"
    assert headers["retry-after"] == "3" and headers["retry-after-ms"] == "3000"  # a quarter of 12 s
    assert error_of(verdict)["code"] == "engine_unavailable"
    assert rig.refusals("rejected") == 1
    assert rig.total("extproc_tokens_reserved_total") == 0 and rig.leaked() == []


async def test_the_refusals_stop_the_moment_the_feed_sees_an_engine_again() -> None:
    rig = await DownRig().start()
    rig.down_for = 30.0
    assert isinstance(await rig.decide(rig.admission.exchange(), chat()), Refusal)
    rig.down_for = None
    assert isinstance(await rig.decide(rig.admission.exchange(), chat()), Forward)
    assert rig.active == 1


async def test_shadow_mode_counts_the_engine_down_refusal_and_forwards() -> None:
    rig = await DownRig({**CONFIG, "shadow": True}).start()
    rig.down_for = 5.0
    assert isinstance(await rig.decide(rig.admission.exchange(), chat()), Forward)
    assert rig.refusals("shadow_rejected") == 1
    assert rig.active == 0


async def admitted(rig: DownRig, reported: bool = False) -> tuple[Exchange, Forward]:
    exchange = rig.admission.exchange(reported=reported)
    verdict = await rig.decide(exchange, chat())
    assert isinstance(verdict, Forward) and rig.active == 1 and rig.budget.demand_tokens > 0
    return exchange, verdict


async def test_inline_envoys_connection_failure_settles_as_the_engine_unreachable() -> None:
    rig = await DownRig().start()
    exchange, _ = await admitted(rig)
    reply = exchange.response_headers(
        503, "application/json", False, from_router=False, engine_unreachable=True
    )
    assert isinstance(reply, Refusal) and reply.reason == "engine_down"
    assert dict(reply.headers)["retry-after"] == "1"  # the feed has not seen it down yet: the least
    assert error_of(reply)["code"] == "engine_unavailable"
    exchange.stream_ended()
    await rig.settled()
    assert rig.metric("extproc_settlements_total", outcome="engine_unreachable") == 1
    assert rig.metric("extproc_settlements_total", outcome="not_forwarded") == 0
    assert rig.total_prompt() == 0 and rig.leaked() == []


async def test_inline_a_pickers_503_is_still_not_forwarded() -> None:
    rig = await DownRig().start()
    exchange, _ = await admitted(rig)
    reply = exchange.response_headers(503, "application/json", False, from_router=False)
    assert isinstance(reply, Forward)
    exchange.stream_ended()
    await rig.settled()
    assert rig.metric("extproc_settlements_total", outcome="not_forwarded") == 1
    assert rig.metric("extproc_settlements_total", outcome="engine_unreachable") == 0
    assert rig.leaked() == []


async def test_inline_envoys_503_after_the_engines_connection_closed_keeps_the_backend_error_rule() -> None:
    """A 503 Envoy made after the engine's connection closed with the request sent (UC: an engine stopping
    as it came): forwarded and charged its prompt, as the lean profile's end report settles it, never
    counted as a picker's refusal (`not_forwarded`, the alert that sends on-call to the picker)."""
    rig = await DownRig().start()
    exchange, _ = await admitted(rig)
    reply = exchange.response_headers(503, "text/plain", False, from_router=False, upstream_reset=True)
    assert isinstance(reply, Forward)
    exchange.stream_ended()
    await rig.settled()
    assert rig.metric("extproc_settlements_total", outcome="upstream_error") == 1
    assert rig.metric("extproc_settlements_total", outcome="not_forwarded") == 0
    assert rig.total_prompt() > 0 and rig.leaked() == []


async def test_lean_an_end_report_with_envoys_connection_failure_settles_as_the_engine_unreachable() -> None:
    rig = await DownRig().start()
    exchange, verdict = await admitted(rig, reported=True)
    assert verdict.report is not None
    exchange.stream_ended()
    reading = ResponseReading(body='{"error":{"code":"service_unavailable"}}', body_end=True)
    unseen = rig.admission.unseen
    assert unseen.report(
        verdict.report.key, 503, reading, forwarded=False, engine_answered=False, engine_unreachable=True
    )
    await rig.settled()
    assert rig.metric("extproc_settlements_total", outcome="engine_unreachable") == 1
    assert rig.total_prompt() == 0 and rig.leaked() == []


def with_flags(flags: float | None) -> pb.ProcessingRequest:
    request = pb.ProcessingRequest()
    if flags is not None:
        attributes = struct_pb2.Struct()
        attributes.update({"response.flags": flags})
        request.attributes[EXT_PROC_ATTRIBUTES].CopyFrom(attributes)
    return request


def test_envoys_response_flags_say_unreachable_for_uf_and_uh_only() -> None:
    assert engine_unreachable(with_flags(32800))  # UF | URX: a refused connection after its retries
    assert engine_unreachable(with_flags(0x2))  # UH: no healthy upstream
    assert not engine_unreachable(with_flags(0x10))  # UR: the engine reset after it had the request
    assert not engine_unreachable(with_flags(0))
    assert not engine_unreachable(with_flags(None))


def test_envoys_response_flags_say_reset_for_ur_and_uc_only() -> None:
    assert upstream_reset(with_flags(0x10))  # UR: the engine reset the stream
    assert upstream_reset(with_flags(0x40))  # UC: the engine's connection closed
    assert not upstream_reset(with_flags(32800))  # UF | URX: never connected
    assert not upstream_reset(with_flags(0x2)) and not upstream_reset(with_flags(None))
