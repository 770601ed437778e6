"""Priority classes through the ext_proc servicer: guarantees, waiting, shadow mode, tenant sources."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest
from envoy.config.core.v3 import base_pb2
from google.protobuf import struct_pb2

from extproc.config import parse_config
from tests.support.classes import CONFIG, admit, start
from tests.support.servicer import (
    Harness,
    Stream,
    body_msg,
    chat,
    header_map,
    headers_msg,
    resp_body_msg,
    resp_headers_msg,
)
from tests.support.waiting import eventually


@pytest.fixture
async def harness() -> AsyncIterator[Harness]:
    sidecar, channel = await start(CONFIG)
    try:
        yield Harness(sidecar, channel)
    finally:
        await channel.close()
        await sidecar.stop(grace_s=1)


async def finish(s: Stream) -> None:
    await s.send(resp_headers_msg(200, "application/json"))
    await s.send(resp_body_msg(b'{"usage":{"prompt_tokens":5,"completion_tokens":3}}', eos=True))
    await s.close()


async def test_batch_flood_cannot_take_the_critical_guarantee(harness: Harness) -> None:
    held = []
    for _ in range(6):
        s, reply = await admit(harness, "nightly")
        if reply.HasField("request_body"):
            held.append(s)
        else:
            assert reply.immediate_response.status.code == 429
            s.cancel()
    assert len(held) == 2  # its own guarantee (1) + the pool (4 - 2 - 1 = 1)
    for _ in range(2):
        s, reply = await admit(harness, "chat")
        assert reply.HasField("request_body"), "critical refused inside its guarantee"
        held.append(s)
    assert harness.metric("extproc_share_active_requests", key="model:m", share="critical") == 2
    assert harness.metric("extproc_requests_total", decision="rejected", **{"class": "batch"}) == 4
    assert harness.metric("extproc_tenant_requests_total", tenant="chat", decision="admitted") == 2
    assert harness.metric("extproc_tenant_requests_total", tenant="other", decision="rejected") == 4
    for s in held:
        s.cancel()


async def test_critical_waits_and_gets_in_when_a_slot_frees(harness: Harness) -> None:
    held = [await admit(harness, "chat") for _ in range(3)]  # 2 guaranteed + the pool's 1
    assert all(reply.HasField("request_body") for _, reply in held)
    s = harness.stream()
    await s.send(headers_msg("POST", "/v1/chat/completions", headers={"x-tenant-id": "chat"}))
    await s.call.write(body_msg(chat(max_tokens=10)))
    override = await asyncio.wait_for(s.call.read(), 5)
    assert override.override_message_timeout.seconds >= 3  # Envoy's timer extended before waiting
    await eventually(lambda: harness.metric("extproc_queue_depth", **{"class": "critical"}) == 1)
    await finish(held[0][0])
    admitted = await asyncio.wait_for(s.call.read(), 5)
    assert admitted.HasField("request_body")
    assert harness.metric("extproc_queue_depth", **{"class": "critical"}) == 0
    assert (
        harness.metric("extproc_queue_wait_seconds_count", outcome="admitted", **{"class": "critical"}) == 1
    )
    for stream, _ in held[1:]:
        stream.cancel()
    s.cancel()


async def test_waiter_that_leaves_leaves_the_queue_and_deadline_answers_429(harness: Harness) -> None:
    held = [await admit(harness, "chat") for _ in range(3)]
    leaver = harness.stream()
    await leaver.send(headers_msg("POST", "/v1/chat/completions", headers={"x-tenant-id": "chat"}))
    await leaver.call.write(body_msg(chat(max_tokens=10)))
    await asyncio.wait_for(leaver.call.read(), 5)  # the timeout override comes just before it queues
    await eventually(lambda: harness.metric("extproc_queue_depth", **{"class": "critical"}) == 1)
    leaver.cancel()
    await eventually(lambda: harness.metric("extproc_queue_depth", **{"class": "critical"}) == 0)
    assert (
        harness.metric("extproc_queue_wait_seconds_count", outcome="cancelled", **{"class": "critical"}) == 1
    )
    # A waiter whose deadline passes gets a 429 with retry-after.
    config = json.loads(json.dumps(CONFIG))
    config["classes"][0]["queue"]["max_wait_seconds"] = 0.3
    await harness.sidecar.apply_config(parse_config(config))
    s = harness.stream()
    await s.send(headers_msg("POST", "/v1/chat/completions", headers={"x-tenant-id": "chat"}))
    await s.call.write(body_msg(chat(max_tokens=10)))
    await asyncio.wait_for(s.call.read(), 5)
    reply = await asyncio.wait_for(s.call.read(), 5)
    assert reply.immediate_response.status.code == 429
    headers = header_map(reply.immediate_response.headers)
    assert headers["x-extproc-reject-reason"] == "queue_timeout"
    assert int(headers["retry-after"]) >= 1
    for stream, _ in held:
        stream.cancel()
    s.cancel()
    await eventually(lambda: harness.metric("extproc_active_requests") == 0)


async def test_full_queue_answers_429_at_once(harness: Harness) -> None:
    held = [await admit(harness, "chat") for _ in range(3)]
    waiting = []
    for _ in range(2):
        s = harness.stream()
        await s.send(headers_msg("POST", "/v1/chat/completions", headers={"x-tenant-id": "chat"}))
        await s.call.write(body_msg(chat(max_tokens=10)))
        await asyncio.wait_for(s.call.read(), 5)
        waiting.append(s)
    await eventually(lambda: harness.metric("extproc_queue_depth", **{"class": "critical"}) == 2)
    s = harness.stream()
    await s.send(headers_msg("POST", "/v1/chat/completions", headers={"x-tenant-id": "chat"}))
    await s.call.write(body_msg(chat(max_tokens=10)))
    await asyncio.wait_for(s.call.read(), 5)  # extension, then the refusal
    reply = await asyncio.wait_for(s.call.read(), 5)
    assert header_map(reply.immediate_response.headers)["x-extproc-reject-reason"] == "queue_full"
    for stream in [*(h for h, _ in held), *waiting, s]:
        stream.cancel()


async def test_classes_without_a_queue_get_an_instant_429(harness: Harness) -> None:
    held = [await admit(harness, None) for _ in range(1)]  # standard: pool only (1 slot)
    assert held[0][1].HasField("request_body")
    s, reply = await admit(harness, None)
    assert reply.immediate_response.status.code == 429
    assert header_map(reply.immediate_response.headers)["x-extproc-reject-reason"] == "concurrency"
    for stream in [held[0][0], s]:
        stream.cancel()


async def test_shadow_mode_admits_everything_while_counting() -> None:
    config = json.loads(json.dumps(CONFIG))
    config["shadow"] = True
    sidecar, channel = await start(config)
    h = Harness(sidecar, channel)
    try:
        streams = []
        for _ in range(8):
            s, reply = await admit(h, "nightly")
            assert reply.HasField("request_body")
            streams.append(s)
        assert h.metric("extproc_requests_total", decision="admitted", **{"class": "batch"}) == 2
        assert h.metric("extproc_requests_total", decision="shadow_rejected", reason="concurrency") == 6
        assert h.metric("extproc_active_requests") == 2  # shadow-passed requests hold no lease
        for s in streams:
            s.cancel()
        await eventually(lambda: h.metric("extproc_active_requests") == 0)
    finally:
        await channel.close()
        await sidecar.stop(grace_s=1)


async def test_tenant_from_envoy_metadata_and_spoofed_header_ignored() -> None:
    config = json.loads(json.dumps(CONFIG))
    config["admission"]["tenant"] = {"metadata": {"namespace": "llm.auth", "key": "tenant"}}
    sidecar, channel = await start(config)
    h = Harness(sidecar, channel)
    try:
        # The header is not a trusted source in this config: claiming "chat" through it gains nothing.
        s, reply = await admit(h, "chat")
        assert reply.HasField("request_body")
        assert h.metric("extproc_requests_total", decision="admitted", **{"class": "standard"}) == 1
        s.cancel()
        # Metadata set by an earlier filter is trusted.
        s2 = h.stream()
        request = headers_msg("POST", "/v1/chat/completions")
        fields = struct_pb2.Struct()
        fields.update({"tenant": "chat"})
        request.metadata_context.CopyFrom(base_pb2.Metadata(filter_metadata={"llm.auth": fields}))
        await s2.send(request)
        reply = await s2.send(body_msg(chat(max_tokens=10)))
        assert reply.HasField("request_body")
        assert h.metric("extproc_requests_total", decision="admitted", **{"class": "critical"}) == 1
        s2.cancel()
    finally:
        await channel.close()
        await sidecar.stop(grace_s=1)


async def test_batch_streams_cut_when_kv_passes_the_watermark() -> None:
    config = json.loads(json.dumps(CONFIG))
    config["classes"][2]["cut_streams_above_kv"] = 0.95
    sidecar, channel = await start(config)
    h = Harness(sidecar, channel)
    usage = {"m": 0.5}
    sidecar.admission.deps.kv_usage = lambda pool: usage.get(pool)
    try:
        s, reply = await admit(h, "nightly")
        assert reply.HasField("request_body")
        await s.send(resp_headers_msg(200, "text/event-stream"))
        ok = await s.send(resp_body_msg(b'data: {"choices":[{"index":0,"delta":{"content":" a"}}]}\n\n'))
        assert ok.HasField("response_body")
        usage["m"] = 0.97
        cut = await s.send(resp_body_msg(b'data: {"choices":[{"index":0,"delta":{"content":" b"}}]}\n\n'))
        assert cut.immediate_response.status.code == 503
        await eventually(lambda: h.metric("extproc_active_requests") == 0)
        await sidecar.admission.drain()
        assert h.metric("extproc_streams_cut_total", **{"class": "batch"}) == 1
        assert h.metric("extproc_settlements_total", outcome="cut") == 1
        assert h.metric("extproc_tokens_settled_total", kind="completion") == 1
        # A critical stream is not cut.
        s2, _ = await admit(h, "chat")
        await s2.send(resp_headers_msg(200, "text/event-stream"))
        ok = await s2.send(resp_body_msg(b'data: {"choices":[{"index":0,"delta":{"content":" a"}}]}\n\n'))
        assert ok.HasField("response_body")
        s2.cancel()
    finally:
        await channel.close()
        await sidecar.stop(grace_s=1)
