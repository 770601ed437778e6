"""One request through admission in each profile, built as the sidecar builds it (`build_admission`) but
with no gRPC, no Envoy and an injected clock: the decision, the in-flight request and its one settlement."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from extproc.admission.exchange import Exchange, Phase, RequestHead
from extproc.admission.replies.verdicts import Forward, Refusal
from extproc.admission.tracking.inflight import InFlight
from extproc.admission.tracking.reading import OPENAI_SPEC, ReportedTiming, ResponseReading
from tests.unit.admission.exchange_rig import CONFIG, Rig, chat

USAGE_81 = b'data: {"choices":[],"usage":{"prompt_tokens":11,"completion_tokens":81,"total_tokens":92}}\n\n'


def phase(exchange: Exchange) -> Phase:
    """The exchange's phase, read afresh (each call may have moved it)."""
    return exchange.phase


async def test_inline_a_streamed_answer_settles_at_its_end_and_teaches_the_decode_rate() -> None:
    rig = await Rig().start()
    exchange = rig.admission.exchange()
    verdict = await rig.decide(exchange, chat(stream=True))
    assert isinstance(verdict, Forward) and verdict.report is None and phase(exchange) is Phase.ADMITTED
    assert rig.active == 1
    exchange.response_headers(200, "text/event-stream", end_of_stream=False)
    await exchange.response_body(b'data: {"choices":[{"index":0,"delta":{"content":"a"}}]}\n\n', False)
    rig.clock.advance(2.0)
    await exchange.response_body(USAGE_81 + b"data: [DONE]\n\n", True)
    assert phase(exchange) is Phase.SETTLED
    await rig.settled()
    assert rig.active == 0
    assert rig.metric("extproc_settlements_total", outcome="completed") == 1
    assert rig.admission.service.paces.rate("*") == pytest.approx(40.0)  # 80 tokens after the first, 2 s


async def test_inline_an_answer_delivered_in_a_burst_teaches_no_decode_rate() -> None:
    """Chunks a proxy held and then sent at once (seen on the real engine: a whole answer within 10 ms) time
    the delivery, not the decode: learning "8,000 tokens per second" from them would charge every later
    disconnect of the pool its whole reservation."""
    rig = await Rig().start()
    exchange = rig.admission.exchange()
    await rig.decide(exchange, chat(stream=True))
    exchange.response_headers(200, "text/event-stream", end_of_stream=False)
    await exchange.response_body(b'data: {"choices":[{"index":0,"delta":{"content":"a"}}]}\n\n', False)
    rig.clock.advance(0.01)
    await exchange.response_body(USAGE_81 + b"data: [DONE]\n\n", True)
    await rig.settled()
    assert rig.metric("extproc_settlements_total", outcome="completed") == 1
    assert not rig.admission.service.paces.learned("*")


async def test_lean_the_forward_verdict_carries_the_report_ticket_and_metadata() -> None:
    rig = await Rig(concurrency=4).start()
    exchange = rig.admission.exchange(reported=True)
    head = RequestHead("POST", "/v1/chat/completions", {}, tenant="nightly")
    verdict = await rig.decide(exchange, chat(stream=True), head)
    assert isinstance(verdict, Forward) and verdict.report is not None
    assert verdict.report.spec is OPENAI_SPEC and verdict.report.strip_usage
    metadata = dict(verdict.metadata)
    assert metadata["x-vllm-priority"] == "7"
    assert metadata["x-ratelimit-remaining-requests"] == "3"
    exchange.stream_ended()  # the stream's end starts the bounded wait, it does not settle
    assert phase(exchange) is Phase.ADMITTED and rig.active == 1
    usage = json.dumps({"prompt_tokens": 9, "completion_tokens": 81})
    reading = ResponseReading(events=81, events_at_usage=81, usage_last=usage, final=True, body_end=True)
    unseen = rig.admission.unseen
    assert unseen.report(verdict.report.key, 200, reading, ReportedTiming(1.0, 2.0))
    assert not unseen.report(verdict.report.key, 200, reading)  # settled once; the key is spent
    await rig.settled()
    assert rig.active == 0 and phase(exchange) is Phase.SETTLED
    assert rig.metric("extproc_settlements_total", outcome="completed") == 1
    # The same function learned the pace as the inline profile's: 80 tokens after the first over 2 s.
    assert rig.admission.service.paces.rate("*") == pytest.approx(40.0)


async def test_lean_a_lost_report_channel_expires_an_ended_request_at_once() -> None:
    rig = await Rig().start()
    exchange = rig.admission.exchange(reported=True)
    verdict = await rig.decide(exchange, chat())
    assert isinstance(verdict, Forward) and verdict.report is not None
    channel = rig.admission.unseen.channel
    channel.stream_opened()
    channel.stream_closed()
    assert channel.lost
    rig.clock.advance(0.5)
    exchange.stream_ended()
    await rig.settled()
    assert rig.active == 0
    assert rig.metric("extproc_settlements_total", outcome="expired") == 1
    assert rig.admission.unseen.awaiting_reports() == []


async def test_inline_an_admission_the_transport_never_took_is_refunded_in_full() -> None:
    """The stream was reset before the admitting reply left (Envoy's message timer, or the client gone): the
    proxy never had the verdict and, failing closed, sent nothing upstream."""
    rig = await Rig().start()
    exchange = rig.admission.exchange()
    await rig.decide(exchange, chat())
    exchange.reply_undelivered()
    exchange.stream_ended()
    await rig.settled()
    assert rig.active == 0
    assert rig.metric("extproc_settlements_total", outcome="not_forwarded") == 1
    reserved = rig.total("extproc_tokens_reserved_total")
    assert reserved > 0 and rig.total("extproc_tokens_refunded_total") == reserved


async def test_inline_a_reply_lost_once_the_answer_began_keeps_the_abort_charge() -> None:
    rig = await Rig().start()
    exchange = rig.admission.exchange()
    await rig.decide(exchange, chat())
    exchange.response_headers(200, "application/json", end_of_stream=False)
    exchange.reply_undelivered()  # a later reply: the request was forwarded
    exchange.stream_ended()
    await rig.settled()
    assert rig.metric("extproc_settlements_total", outcome="aborted") == 1


async def test_lean_an_end_report_outranks_a_reply_thought_undelivered() -> None:
    """Where the proxy did take the verdict after all, its end report says what happened and is charged."""
    rig = await Rig().start()
    exchange = rig.admission.exchange(reported=True)
    verdict = await rig.decide(exchange, chat())
    assert isinstance(verdict, Forward) and verdict.report is not None
    exchange.reply_undelivered()
    exchange.stream_ended()
    usage = json.dumps({"prompt_tokens": 9, "completion_tokens": 81})
    reading = ResponseReading(body=json.dumps({"usage": json.loads(usage)}), body_end=True)
    assert rig.admission.unseen.report(verdict.report.key, 200, reading)
    await rig.settled()
    assert rig.metric("extproc_settlements_total", outcome="completed") == 1


async def test_lean_an_undelivered_admission_settles_as_not_forwarded_without_a_miss() -> None:
    rig = await Rig().start()
    exchange = rig.admission.exchange(reported=True)
    await rig.decide(exchange, chat(), RequestHead("POST", "/v1/chat/completions", {}, request_id="r1"))
    channel = rig.admission.unseen.channel
    channel.stream_opened()
    channel.stream_closed()  # lost: an ended request gives up at once, no timer
    rig.admission.unseen.unforwarded("r1")
    exchange.stream_ended()
    await rig.settled()
    assert rig.active == 0
    assert rig.metric("extproc_settlements_total", outcome="not_forwarded") == 1
    assert rig.metric("extproc_settlements_total", outcome="expired") == 0


def sampled(n: int, max_tokens: int) -> bytes:
    body = json.loads(chat(max_tokens, stream=True))
    body["n"] = n
    return json.dumps(body).encode()


def event(index: int) -> bytes:
    return b'data: {"choices":[{"index":%d,"delta":{"content":"a"}}]}\n\n' % index


async def test_inline_a_stream_of_n_sequences_left_early_is_charged_whole_steps_of_all() -> None:
    """Eight sequences decoded together; the client left after the first step of each and two of the second:
    the engine had generated two tokens of every one (16), not the 10 that passed, and the step running
    when the abort reached it one more of each (24)."""
    rig = await Rig().start()
    exchange = rig.admission.exchange()
    await rig.decide(exchange, sampled(8, 24))
    exchange.response_headers(200, "text/event-stream", end_of_stream=False)
    for index in [*range(8), 0, 1]:
        await exchange.response_body(event(index), False)
    exchange.stream_ended()
    await rig.settled()
    assert rig.metric("extproc_settlements_total", outcome="aborted") == 1
    assert rig.total("extproc_tokens_settled_total") - rig.total_prompt() == 16 + 8


HELD_CONFIG: dict[str, Any] = {**CONFIG, "admission": {**CONFIG["admission"], "proxy_buffer_bytes": 64}}
"""A proxy that buffers 64 bytes for a reader: two events fill it, and the reader may have held the engine's
stream back from then on."""


async def left_after_two_seconds(rig: Rig, learned: float | None) -> float:
    """Two sequences, one token each passed, then 2 s to the client's leaving; the feed's pace is 20 tokens
    a second, the learned one `learned`. The completion charged."""
    rates = rig.admission.service.paces
    rates.fed = lambda _pool: 20.0
    if learned is not None:
        rates.observe("*", learned * 100, 100.0)
    exchange = rig.admission.exchange()
    assert isinstance(await rig.decide(exchange, sampled(2, 200)), Forward)
    exchange.response_headers(200, "text/event-stream", end_of_stream=False)
    for index in (0, 1):
        await exchange.response_body(event(index), False)
    rig.clock.advance(2.0)
    exchange.stream_ended()
    await rig.settled()
    return rig.total("extproc_tokens_settled_total") - rig.total_prompt()


async def test_inline_a_stream_left_before_it_filled_the_proxys_buffer_is_charged_what_passed() -> None:
    """Under the proxy's buffer nothing held the engine's stream back: whatever the pace learned or fed, the
    engine sent no token in those 2 s that did not pass (it decoded two sequences far slower than one), so
    the charge is the step that passed and the one the abort let finish, 4 of the 200 reserved."""
    for learned in (None, 30.0):
        assert await left_after_two_seconds(await Rig().start(), learned) == 2 * (1 + 1)


async def test_inline_a_stream_left_is_charged_the_larger_of_the_learned_and_the_fed_pace() -> None:
    """The same stream where the proxy's buffer was full: the reader may have held the engine back, and the
    two tokens that passed are no measure. Nothing learned: the engines' own pace from the feed (20 a
    second) gives 1 + 40 tokens each. A pace learned below it (a delivery pace) does not lower that; one
    learned above it counts."""
    charged = [
        await left_after_two_seconds(await Rig(HELD_CONFIG).start(), learned) for learned in (None, 5.0, 30.0)
    ]
    assert charged == [2 * 41, 2 * 41, 2 * 61]


async def test_lean_a_stream_left_is_charged_what_passed_under_the_buffer_and_the_pace_over_it() -> None:
    """The end report of two sequences left 2 s after their first tokens, the feed's pace 20 a second:
    Envoy's `response_body_bytes` under the proxy's buffer, and the two that passed are what the engine
    generated, with the step the abort let finish (4); over it (a proxy of 64 bytes here), or not told, the
    feed's pace (82)."""
    charged = []
    for passed_bytes in (32, 120, None):
        rig = await Rig(HELD_CONFIG).start()
        rig.admission.service.paces.fed = lambda _pool: 20.0
        exchange = rig.admission.exchange(reported=True)
        verdict = await rig.decide(exchange, sampled(2, 200))
        assert isinstance(verdict, Forward) and verdict.report is not None
        exchange.stream_ended()
        reading = ResponseReading(events=2)
        timing = ReportedTiming(first_token_after_s=0.5, decode_s=2.0)
        rig.admission.unseen.report(verdict.report.key, 200, reading, timing, passed_bytes=passed_bytes)
        await rig.settled()
        charged.append(rig.total("extproc_tokens_settled_total") - rig.total_prompt())
    assert charged == [2 * (1 + 1), 2 * 41, 2 * 41]


CUT_CONFIG: dict[str, Any] = {
    **CONFIG,
    "classes": [{"name": "standard", "cut_streams_above_kv": 0.9}, {"name": "batch"}],
}


async def test_inline_one_cut_rule_resets_a_stream_over_its_class_watermark() -> None:
    rig = await Rig(CUT_CONFIG).start()
    exchange = rig.admission.exchange()
    await rig.decide(exchange, chat(stream=True))
    exchange.response_headers(200, "text/event-stream", end_of_stream=False)
    rig.kv_usage = 0.5
    chunk = b'data: {"choices":[{"index":0,"delta":{"content":"a"}}]}\n\n'
    assert isinstance(await exchange.response_body(chunk, False), Forward)
    rig.kv_usage = 0.95
    cut = await exchange.response_body(chunk, False)
    assert isinstance(cut, Refusal) and phase(exchange) is Phase.SETTLED
    await rig.settled()
    assert rig.metric("extproc_settlements_total", outcome="cut") == 1
    assert rig.metric("extproc_streams_cut_total", **{"class": "standard"}) == 1


async def test_lean_the_tick_cuts_through_the_open_stream_and_the_report_settles_it_as_cut() -> None:
    rig = await Rig(CUT_CONFIG).start()
    exchange = rig.admission.exchange(reported=True)
    verdict = await rig.decide(exchange, chat(stream=True))
    assert isinstance(verdict, Forward) and verdict.report is not None
    unseen = rig.admission.unseen
    never: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    waiting = asyncio.ensure_future(exchange.next_or_cut(never))  # as the lean translator waits
    await asyncio.sleep(0)  # let it register (no time passes)
    unseen.tick()
    assert not waiting.done()  # under the watermark
    rig.kv_usage = 0.95
    unseen.tick()
    cut = await waiting
    assert isinstance(cut, Refusal)
    assert never.cancelled()
    exchange.stream_ended()
    assert unseen.report(verdict.report.key, 200, ResponseReading(events=3))
    await rig.settled()
    assert rig.metric("extproc_settlements_total", outcome="cut") == 1


async def test_a_translator_asks_the_exchange_alone_for_the_tenant_source_and_the_next_step() -> None:
    rig = await Rig(CUT_CONFIG).start()
    exchange = rig.admission.exchange()
    assert exchange.tenant_source().header == "x-tenant"
    await rig.decide(exchange, chat(stream=True))
    rig.kv_usage = 0.95
    # Inline: nothing is cut while it waits (the cut comes with the next chunk), the next message comes.
    following: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    following.set_result("next")
    assert await exchange.next_or_cut(following) == "next"
    exchange.close()
    await rig.settled()


async def test_a_slot_refusal_hints_from_the_request_held_open_here() -> None:
    """The retry hint reads the open streams' in-flight requests; nothing calls back into an exchange."""
    rig = await Rig(concurrency=1).start()
    service = rig.admission.service
    holder = rig.admission.exchange()
    rig.admission.streams.add(holder)
    assert isinstance(await rig.decide(holder, chat(max_tokens=100)), Forward)
    assert isinstance(holder.inflight, InFlight)
    assert holder.inflight.open_lease("global") is not None
    refused = await rig.decide(rig.admission.exchange(), chat())
    assert isinstance(refused, Refusal) and refused.reason == "concurrency"
    retry_after = dict(refused.headers)["retry-after-ms"]
    # 100 tokens at the assumed decode rate: the holder's expected remaining time, not the store's average.
    rate = service.paces.rate("*")
    assert int(retry_after) == pytest.approx(100 / rate * 1000, rel=0.2)
    holder.close()
    await rig.settled()
    assert rig.active == 0
