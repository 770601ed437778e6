"""The ext_proc servicer driven over a real gRPC channel, message by message, as Envoy drives it."""

from __future__ import annotations

import json
import math
from collections.abc import AsyncIterator

import grpc
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc.admission.replies import refusals
from extproc.config import parse_config
from extproc.core.clock import FakeClock
from tests.support.servicer import (
    BASE_CONFIG,
    Harness,
    body_msg,
    chat,
    header_map,
    headers_msg,
    resp_body_msg,
    resp_headers_msg,
    serving,
)
from tests.support.waiting import eventually


@pytest.fixture
async def harness() -> AsyncIterator[Harness]:
    async with serving(BASE_CONFIG) as (sidecar, channel):
        yield Harness(sidecar, channel)


async def test_non_llm_path_passes_through_with_mode_override(harness: Harness) -> None:
    s = harness.stream()
    reply = await s.send(headers_msg("GET", "/v1/models", eos=True))
    assert reply.HasField("request_headers")
    assert reply.mode_override.request_body_mode == reply.mode_override.NONE
    assert reply.mode_override.response_body_mode == reply.mode_override.NONE
    await s.close()
    assert harness.metric("extproc_requests_total", decision="passthrough") == 1


async def test_content_length_over_cap_is_413_once_the_body_arrived(harness: Harness) -> None:
    """Refused at the headers, the 413 would race the client's upload and often be reset (exchange.py)."""
    s = harness.stream()
    reply = await s.send(headers_msg("POST", "/v1/chat/completions", headers={"content-length": "5000"}))
    assert reply.HasField("request_headers")
    reply = await s.send(body_msg(b"x" * 5000))
    assert reply.immediate_response.status.code == 413
    error = json.loads(reply.immediate_response.body)["error"]
    # The message names the body's size and the cap it is over (admission.max_body_bytes: 4096 here).
    assert (error["code"], error["message"]) == ("request_too_large", refusals.too_large_message(5000, 4096))
    assert error["message"].startswith(refusals.BODY_TOO_LARGE) and "4096 bytes" in error["message"]
    s.cancel()


async def test_body_over_cap_is_413_even_without_content_length(harness: Harness) -> None:
    s = harness.stream()
    await s.send(headers_msg("POST", "/v1/chat/completions"))
    reply = await s.send(body_msg(b"x" * 5000))
    assert reply.immediate_response.status.code == 413
    s.cancel()


async def test_invalid_json_is_400_naming_the_problem(harness: Harness) -> None:
    s = harness.stream()
    await s.send(headers_msg("POST", "/v1/chat/completions"))
    reply = await s.send(body_msg(b"{not json"))
    assert reply.immediate_response.status.code == 400
    error = json.loads(reply.immediate_response.body)["error"]
    assert error["code"] == "invalid_json"
    assert header_map(reply.immediate_response.headers)["content-type"] == "application/json"
    s.cancel()
    assert harness.metric("extproc_active_requests") == 0


async def test_context_overflow_is_400(harness: Harness) -> None:
    s = harness.stream()
    await s.send(headers_msg("POST", "/v1/chat/completions"))
    reply = await s.send(body_msg(chat(max_tokens=995)))
    assert reply.immediate_response.status.code == 400
    assert json.loads(reply.immediate_response.body)["error"]["code"] == "context_length_exceeded"
    s.cancel()


async def test_empty_body_on_llm_path_is_400(harness: Harness) -> None:
    s = harness.stream()
    reply = await s.send(headers_msg("POST", "/v1/chat/completions", eos=True))
    assert reply.immediate_response.status.code == 400
    s.cancel()


async def test_full_buffered_exchange_settles_to_reported_usage(harness: Harness) -> None:
    s = harness.stream()
    assert (await s.send(headers_msg("POST", "/v1/chat/completions"))).HasField("request_headers")
    reply = await s.send(body_msg(chat(max_tokens=50)))
    assert reply.HasField("request_body")
    assert not reply.request_body.response.HasField("body_mutation")  # not streamed: body untouched
    assert harness.metric("extproc_active_requests") == 1
    reserved = harness.metric("extproc_tokens_reserved_total", model="other")
    assert reserved > 50
    reply = await s.send(resp_headers_msg(200, "application/json"))
    added = header_map(reply.response_headers.response.header_mutation)
    assert added["x-ratelimit-limit-requests"] == "2"
    assert added["x-ratelimit-remaining-requests"] == "1"
    assert added["x-ratelimit-limit-tokens"] == "6000"  # global is the only key with a TPM limit here
    usage = {"prompt_tokens": 12, "completion_tokens": 7, "total_tokens": 19}
    body = json.dumps({"choices": [{"message": {"content": "x"}}], "usage": usage}).encode()
    await s.send(resp_body_msg(body[:10]))
    await s.send(resp_body_msg(body[10:], eos=True))
    await s.close()
    await eventually(lambda: harness.metric("extproc_active_requests") == 0)
    await harness.settled()
    assert harness.metric("extproc_settlements_total", outcome="completed") == 1
    assert harness.metric("extproc_tokens_refunded_total", model="other") == reserved - 19


async def test_streamed_request_gets_include_usage_and_the_chunk_is_hidden(harness: Harness) -> None:
    s = harness.stream()
    await s.send(headers_msg("POST", "/v1/chat/completions"))
    reply = await s.send(body_msg(chat(stream=True)))
    mutated = json.loads(reply.request_body.response.body_mutation.body)
    assert mutated["stream_options"] == {"include_usage": True}
    cl = header_map(reply.request_body.response.header_mutation)["content-length"]
    assert int(cl) == len(reply.request_body.response.body_mutation.body)
    await s.send(resp_headers_msg(200, "text/event-stream"))
    chunk = b'data: {"choices":[{"index":0,"delta":{"content":" hi"}}]}\n\n'
    usage = b'data: {"choices":[],"usage":{"prompt_tokens":11,"completion_tokens":1,"total_tokens":12}}\n\n'
    r1 = await s.send(resp_body_msg(chunk))
    r2 = await s.send(resp_body_msg(usage + b"data: [DONE]\n\n"))
    r3 = await s.send(resp_body_msg(b"", eos=True))
    seen = b"".join(
        r.response_body.response.body_mutation.body
        if r.response_body.response.HasField("body_mutation")
        else raw
        for r, raw in ((r1, chunk), (r2, usage + b"data: [DONE]\n\n"), (r3, b""))
    )
    assert b"usage" not in seen
    assert b" hi" in seen and b"[DONE]" in seen
    await s.close()
    await harness.settled()
    assert harness.metric("extproc_tokens_settled_total", kind="completion", model="other") == 1
    assert harness.metric("extproc_tokens_settled_total", kind="prompt", model="other") == 11


async def test_concurrency_limit_rejects_with_retry_after_and_ratelimit_headers(harness: Harness) -> None:
    held = []
    for _ in range(2):
        s = harness.stream()
        await s.send(headers_msg("POST", "/v1/chat/completions"))
        assert (await s.send(body_msg(chat()))).HasField("request_body")
        held.append(s)
    s = harness.stream()
    await s.send(headers_msg("POST", "/v1/chat/completions"))
    reply = await s.send(body_msg(chat()))
    immediate = reply.immediate_response
    assert immediate.status.code == 429
    headers = header_map(immediate.headers)
    assert int(headers["retry-after"]) >= 1
    assert headers["x-ratelimit-remaining-requests"] == "0"
    assert headers["x-extproc-reject-reason"] == "concurrency"
    error = json.loads(immediate.body)["error"]
    assert error["code"] == "rate_limit_exceeded" and error["type"] == "requests"
    s.cancel()
    for s in held:
        s.cancel()
    await eventually(lambda: harness.metric("extproc_active_requests") == 0)


async def test_tokens_exhausted_then_admitted_after_refill(harness: Harness) -> None:
    clock = harness.sidecar.clock
    assert isinstance(clock, FakeClock)

    async def attempt() -> pb.ProcessingResponse:
        s = harness.stream()
        await s.send(headers_msg("POST", "/v1/chat/completions", headers={"x-tenant": "small"}))
        reply = await s.send(body_msg(chat(max_tokens=250)))
        if reply.HasField("request_body"):
            await s.send(resp_headers_msg(200, "application/json"))
            usage = {"prompt_tokens": 10, "completion_tokens": 250, "total_tokens": 260}
            await s.send(resp_body_msg(json.dumps({"usage": usage}).encode(), eos=True))
            await s.close()
            await harness.settled()
        else:
            s.cancel()
        return reply

    assert (await attempt()).HasField("request_body")
    assert (await attempt()).HasField("request_body")
    rejected = await attempt()
    assert rejected.immediate_response.status.code == 429
    headers = header_map(rejected.immediate_response.headers)
    assert headers["x-extproc-reject-reason"] == "tokens"
    wait_ms = int(headers["retry-after-ms"])
    clock.advance(wait_ms / 1000)
    again = await attempt()
    assert again.HasField("request_body"), (headers, header_map(again.immediate_response.headers))


async def test_request_larger_than_bucket_is_not_retryable(harness: Harness) -> None:
    s = harness.stream()
    await s.send(headers_msg("POST", "/v1/chat/completions", headers={"x-tenant": "small"}))
    reply = await s.send(body_msg(chat(max_tokens=900)))
    headers = header_map(reply.immediate_response.headers)
    assert reply.immediate_response.status.code == 429
    assert headers["x-should-retry"] == "false"
    assert "retry-after" not in headers
    s.cancel()


async def test_stream_cancelled_mid_response_releases_and_refunds_unstreamed(harness: Harness) -> None:
    s = harness.stream()
    await s.send(headers_msg("POST", "/v1/chat/completions"))
    await s.send(body_msg(chat(max_tokens=100, stream=True)))
    reserved = harness.metric("extproc_tokens_reserved_total", model="other")
    await s.send(resp_headers_msg(200, "text/event-stream"))
    for word in (" one", " two", " three"):
        await s.send(
            resp_body_msg(b'data: {"choices":[{"index":0,"delta":{"content":"' + word.encode() + b'"}}]}\n\n')
        )
    s.cancel()
    await eventually(lambda: harness.metric("extproc_active_requests") == 0)
    await harness.settled()
    assert harness.metric("extproc_settlements_total", outcome="aborted") == 1
    # The three that passed, and the one the engine's step running at the abort generated.
    assert harness.metric("extproc_tokens_settled_total", kind="completion", model="other") == 3 + 1
    prompt = harness.metric("extproc_tokens_settled_total", kind="prompt", model="other")
    assert harness.metric("extproc_tokens_refunded_total", model="other") == reserved - prompt - 4


async def test_stream_cancelled_after_admission_before_response_refunds_completion(harness: Harness) -> None:
    s = harness.stream()
    await s.send(headers_msg("POST", "/v1/chat/completions"))
    await s.send(body_msg(chat(max_tokens=100)))
    await s.close()
    await eventually(lambda: harness.metric("extproc_active_requests") == 0)
    await harness.settled()
    assert harness.metric("extproc_settlements_total", outcome="aborted") == 1
    assert harness.metric("extproc_tokens_settled_total", kind="completion", model="other") == 0


async def test_abort_before_response_headers_is_charged_what_the_backend_generated(harness: Harness) -> None:
    """A non-streamed answer whose client leaves after 0.5 s: the backend decoded for 0.5 s, never zero."""
    clock = harness.sidecar.clock
    assert isinstance(clock, FakeClock)
    s = harness.stream()
    await s.send(headers_msg("POST", "/v1/chat/completions"))
    await s.send(body_msg(chat(max_tokens=100)))
    clock.advance(0.5)
    s.cancel()
    await harness.settled()
    assert harness.metric("extproc_settlements_total", outcome="aborted") == 1
    rate = harness.sidecar.admission.paces.rate("*")
    assert harness.metric("extproc_tokens_settled_total", kind="completion", model="other") == min(
        100, math.ceil(0.5 * rate)
    )


async def test_completed_streams_teach_the_pool_its_decode_rate(harness: Harness) -> None:
    clock = harness.sidecar.clock
    assert isinstance(clock, FakeClock)
    s = harness.stream()
    await s.send(headers_msg("POST", "/v1/chat/completions"))
    await s.send(body_msg(chat(max_tokens=100, stream=True)))
    await s.send(resp_headers_msg(200, "text/event-stream"))
    await s.send(resp_body_msg(b'data: {"choices":[{"index":0,"delta":{"content":"a"}}]}\n\n'))
    clock.advance(2.0)
    usage = b'data: {"choices":[],"usage":{"prompt_tokens":11,"completion_tokens":81,"total_tokens":92}}\n\n'
    await s.send(resp_body_msg(usage + b"data: [DONE]\n\n", eos=True))
    await s.close()
    await harness.settled()
    assert harness.sidecar.admission.paces.rate("*") == pytest.approx(40.0)  # 80 tokens in 2 s


async def test_the_lease_ends_with_the_upstream_answer_not_the_clients_reading(harness: Harness) -> None:
    """The last chunk passed: the engine is done, though the client may read the rest for minutes."""
    s = harness.stream()
    await s.send(headers_msg("POST", "/v1/chat/completions"))
    await s.send(body_msg(chat(max_tokens=100, stream=True)))
    await s.send(resp_headers_msg(200, "text/event-stream"))
    usage = b'data: {"choices":[],"usage":{"prompt_tokens":11,"completion_tokens":7,"total_tokens":18}}\n\n'
    await s.send(resp_body_msg(usage + b"data: [DONE]\n\n", eos=True))
    await harness.settled()  # the ext_proc stream is still open: Envoy has not finished writing to the client
    assert harness.metric("extproc_settlements_total", outcome="completed") == 1
    assert harness.metric("extproc_tokens_settled_total", kind="completion", model="other") == 7
    await s.close()


async def test_a_stream_read_slowly_is_charged_the_learned_pace_not_what_passed(harness: Harness) -> None:
    """The client reads slowly, the proxy holds the engine back by its buffers (here of 64 bytes), and the
    stream is cut at its lifetime bound: 3 events passed in 10 s, but the engine decoded at its learned 40
    tokens/s."""
    small = dict(BASE_CONFIG, admission={**BASE_CONFIG["admission"], "proxy_buffer_bytes": 64})
    await harness.sidecar.apply_config(parse_config(small))
    await test_completed_streams_teach_the_pool_its_decode_rate(harness)
    clock = harness.sidecar.clock
    assert isinstance(clock, FakeClock)
    before = harness.metric("extproc_tokens_settled_total", kind="completion", model="other")
    s = harness.stream()
    await s.send(headers_msg("POST", "/v1/chat/completions"))
    await s.send(body_msg(chat(max_tokens=600, stream=True)))
    await s.send(resp_headers_msg(200, "text/event-stream"))
    for _ in range(3):
        await s.send(resp_body_msg(b'data: {"choices":[{"index":0,"delta":{"content":"a"}}]}\n\n'))
    clock.advance(10.0)
    s.cancel()
    await harness.settled()
    charged = harness.metric("extproc_tokens_settled_total", kind="completion", model="other") - before
    assert charged == 1 + 400  # the first token, then 10 s at 40 tokens/s


async def test_upstream_error_refunds_the_completion_reservation(harness: Harness) -> None:
    s = harness.stream()
    await s.send(headers_msg("POST", "/v1/chat/completions"))
    await s.send(body_msg(chat(max_tokens=100)))
    await s.send(resp_headers_msg(500, "application/json"))
    await s.send(resp_body_msg(b'{"error":{"message":"down"}}', eos=True))
    await s.close()
    await harness.settled()
    await eventually(lambda: harness.metric("extproc_active_requests") == 0)
    assert harness.metric("extproc_settlements_total", outcome="upstream_error") == 1
    assert harness.metric("extproc_tokens_settled_total", kind="completion", model="other") == 0


async def test_an_engine_503_is_refunded_and_made_a_retryable_refusal(harness: Harness) -> None:
    """vLLM's queue is full: the engine read nothing, so the whole reservation comes back at the response
    headers, and the client's 503 gets the sidecar's retry-after and reason, its body passing as it is.
    The hint is the slot forecast of the sidecar's own refusals: the one open stream's allowance of 500
    tokens at the assumed 100 tokens/s frees the engine's place in 5 s (+ up to 15 % jitter), on the
    injected clock."""
    running = harness.stream()
    await running.send(headers_msg("POST", "/v1/chat/completions"))
    await running.send(body_msg(chat(max_tokens=500, stream=True)))
    await running.send(resp_headers_msg(200, "text/event-stream"))
    s = harness.stream()
    await s.send(headers_msg("POST", "/v1/chat/completions"))
    await s.send(body_msg(chat(max_tokens=100)))
    reply = await s.send(resp_headers_msg(503, "application/json"))
    added = header_map(reply.response_headers.response.header_mutation)
    assert 5000 <= int(added["retry-after-ms"]) <= 5750
    assert int(added["retry-after"]) == math.ceil(int(added["retry-after-ms"]) / 1000)
    assert added[refusals.REASON_HEADER] == "engine_busy"
    assert "x-ratelimit-limit-requests" in added
    await eventually(lambda: harness.metric("extproc_settlements_total", outcome="engine_busy") == 1)
    await harness.sidecar.admission.drain()
    for kind in ("prompt", "completion"):  # nothing charged: only the running stream is open
        assert harness.metric("extproc_tokens_settled_total", model="other", kind=kind) == 0
    assert harness.metric("extproc_settlements_total", outcome="upstream_error") == 0
    assert harness.metric("extproc_engine_refusals_total", model="other", reason="queue_full") == 1
    assert harness.metric("extproc_active_requests") == 1  # only the running stream
    await s.close()  # settled: the stream ends, and the engine's OpenAI error body passes as it is
    running.cancel()
    await harness.settled()
    assert harness.metric("extproc_settlements_total", outcome="engine_busy") == 1
    reserved = harness.metric("extproc_tokens_reserved_total", model="other")
    refunded = harness.metric("extproc_tokens_refunded_total", model="other")
    settled = sum(
        harness.metric("extproc_tokens_settled_total", model="other", kind=k)
        for k in ("prompt", "completion")
    )
    assert reserved - refunded + harness.metric("extproc_tokens_overrun_total", model="other") == settled


async def test_an_engine_503_that_is_not_json_is_answered_in_its_place(harness: Harness) -> None:
    """A body the client's SDK cannot parse is replaced: the sidecar answers the 503 itself, with its own
    OpenAI error and the same retry hint; the lease was refunded in full all the same. With nothing open
    to forecast from, the hint is the floor of one second."""
    s = harness.stream()
    await s.send(headers_msg("POST", "/v1/chat/completions"))
    await s.send(body_msg(chat(max_tokens=100)))
    reply = await s.send(resp_headers_msg(503, "text/plain"))
    refused = reply.immediate_response
    assert refused.status.code == 503
    error = json.loads(refused.body)["error"]
    assert error["code"] == "service_unavailable" and "try again in 1s" in error["message"]
    headers = header_map(refused.headers)
    assert (headers["retry-after"], headers["retry-after-ms"]) == ("1", "1000")
    assert headers[refusals.REASON_HEADER] == "engine_busy" and "x-ratelimit-limit-requests" in headers
    await s.close()
    await harness.settled()
    assert harness.metric("extproc_settlements_total", outcome="engine_busy") == 1
    reserved = harness.metric("extproc_tokens_reserved_total", model="other")
    assert reserved > 0 and harness.metric("extproc_tokens_refunded_total", model="other") == reserved


async def test_an_error_a_later_filter_answered_refunds_everything(harness: Harness) -> None:
    """No router header: a filter after the sidecar (an endpoint picker) answered, the engine never saw it."""
    s = harness.stream()
    await s.send(headers_msg("POST", "/v1/chat/completions"))
    await s.send(body_msg(chat(max_tokens=100)))
    await s.send(resp_headers_msg(429, "application/json", from_router=False))
    await s.send(resp_body_msg(b'{"error":{"message":"shed"}}', eos=True))
    await s.close()
    await harness.settled()
    await eventually(lambda: harness.metric("extproc_active_requests") == 0)
    assert harness.metric("extproc_settlements_total", outcome="not_forwarded") == 1
    reserved = harness.metric("extproc_tokens_reserved_total")
    assert reserved > 0 and harness.metric("extproc_tokens_refunded_total") == reserved


async def test_the_routers_own_timeout_keeps_the_backend_error_rule(harness: Harness) -> None:
    """A 504 without the router header is Envoy's upstream timeout: the backend may have read the prompt."""
    s = harness.stream()
    await s.send(headers_msg("POST", "/v1/chat/completions"))
    await s.send(body_msg(chat(max_tokens=100)))
    await s.send(resp_headers_msg(504, "text/plain", from_router=False))
    await s.send(resp_body_msg(b"upstream request timeout", eos=True))
    await s.close()
    await harness.settled()
    await eventually(lambda: harness.metric("extproc_active_requests") == 0)
    assert harness.metric("extproc_settlements_total", outcome="upstream_error") == 1
    assert harness.metric("extproc_tokens_settled_total", kind="prompt", model="other") > 0


async def test_unknown_model_refused_when_configured(harness: Harness) -> None:
    config = dict(BASE_CONFIG, admission={**BASE_CONFIG["admission"], "reject_unknown_models": True})
    await harness.sidecar.apply_config(parse_config(config))
    s = harness.stream()
    await s.send(headers_msg("POST", "/v1/chat/completions"))
    reply = await s.send(body_msg(chat()))
    assert reply.immediate_response.status.code == 404
    assert json.loads(reply.immediate_response.body)["error"]["code"] == "model_not_found"
    s.cancel()


async def test_shutdown_settles_open_streams(harness: Harness) -> None:
    s = harness.stream()
    await s.send(headers_msg("POST", "/v1/chat/completions"))
    await s.send(body_msg(chat()))
    assert harness.metric("extproc_active_requests") == 1
    await harness.sidecar.stop(grace_s=0.2)
    assert harness.metric("extproc_active_requests") == 0
    assert harness.metric("extproc_settlements_total", outcome="aborted") == 1


async def test_admin_endpoints_and_grpc_health(harness: Harness) -> None:
    import aiohttp
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    sidecar = harness.sidecar
    base = f"http://127.0.0.1:{sidecar.admin_port}"
    async with aiohttp.ClientSession() as session:
        for path, expected in (("/healthz", 200), ("/readyz", 200)):
            async with session.get(base + path) as resp:
                assert resp.status == expected
        async with session.get(base + "/metrics") as resp:
            text = await resp.text()
            assert "extproc_decision_seconds_bucket" in text
            assert 'extproc_build_info{version="' in text
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{sidecar.grpc_port}")
    stub = health_pb2_grpc.HealthStub(channel)
    reply = await stub.Check(
        health_pb2.HealthCheckRequest(service="envoy.service.ext_proc.v3.ExternalProcessor")
    )
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    await channel.close()
    sidecar.ready = False  # what stop() does first: readiness fails before streams drain
    async with aiohttp.ClientSession() as session, session.get(base + "/readyz") as resp:
        assert resp.status == 503


async def test_large_json_answer_without_usage_is_counted_off_the_event_loop(harness: Harness) -> None:
    s = harness.stream()
    await s.send(headers_msg("POST", "/v1/chat/completions"))
    await s.send(body_msg(chat(max_tokens=100)))
    await s.send(resp_headers_msg(200, "application/json"))
    text = " word" * 30_000  # 150 KB, no usage object: the sidecar must count it itself
    body = json.dumps({"choices": [{"index": 0, "message": {"role": "assistant", "content": text}}]}).encode()
    half = len(body) // 2
    await s.send(resp_body_msg(body[:half]))
    await s.send(resp_body_msg(body[half:], eos=True))
    await s.close()
    await harness.settled()
    assert harness.metric("extproc_tokens_settled_total", kind="completion", model="other") == 30_000
    assert harness.metric("extproc_tokens_overrun_total", model="other") > 0  # 30k used, 100 reserved


async def test_client_address_comes_from_envoys_source_address_attribute() -> None:
    from google.protobuf.struct_pb2 import Struct

    from extproc.protocol.messages import EXT_PROC_ATTRIBUTES, client_address

    request = headers_msg("POST", "/v1/chat/completions")
    assert client_address(request) is None
    for sent, host in (
        ("10.1.2.3:50123", "10.1.2.3"),
        ("[2001:db8::1]:443", "2001:db8::1"),
        ("pipe", "pipe"),
    ):
        attributes = Struct()
        attributes.update({"source.address": sent})
        request.attributes[EXT_PROC_ATTRIBUTES].CopyFrom(attributes)
        assert client_address(request) == host


async def test_headers_the_engines_read_over_the_body_are_removed(harness: Harness) -> None:
    s = harness.stream()
    reply = await s.send(
        headers_msg(
            "POST", "/v1/chat/completions", headers={"x-vllm-priority": "-100", "x-data-parallel-rank": "0"}
        )
    )
    removed = set(reply.request_headers.response.header_mutation.remove_headers)
    assert removed == {"x-vllm-priority", "x-data-parallel-rank"}
    s.cancel()
    s = harness.stream()
    reply = await s.send(headers_msg("POST", "/v1/chat/completions"))
    assert not reply.request_headers.response.HasField("header_mutation")
    s.cancel()
