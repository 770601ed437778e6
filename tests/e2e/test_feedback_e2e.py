"""The KV feedback loop on localhost: simulator → exporter → sidecar → Envoy, all real processes."""

from __future__ import annotations

import asyncio
import json
import math
import socket
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import aiohttp
import grpc
import pytest

from extproc.envoyconf.profiles import PROFILES
from extproc.kvfeed.proto import feedback_pb2, feedback_pb2_grpc
from tests.support.stack import Stack, build_stack, fixed_step_sim, http, scrape, start_stack
from tests.support.waiting import wait_for

MODEL = "llama-3-8b"
BASE_SLOTS = 10
FIRST_WORDS = (" alpha", " beta", " gamma", " delta", " river", " stone", " cloud", " maple")
"""Single-token words: each stream that fills the cache starts with its own, so none shares a cached block."""
CONFIG: dict[str, Any] = {
    "models": {"*": {"context_window": 2048, "default_max_tokens": 256}},
    "limits": {"models": {MODEL: {"max_concurrency": BASE_SLOTS}}},
    # Fast recovery keeps the test short; production defaults recover at 0.05 per second.
    "adaptive": {"recovery_per_second": 1.0, "stale_after_seconds": 2.0},
}
# 256 blocks of 16 tokens: six 2k-token sequences overflow it. A decode step takes 10 ms.
SIM_ARGS = fixed_step_sim(MODEL, 10, "--num-gpu-blocks", "256", "--max-model-len", "2048")
# For the scale test the engine runs 20x slower than real time (a 200 ms decode step), so six sequences that
# together hold ~90-96% of the cache stay there for ~10 s without any preemption thrash.
STEADY_SIM_ARGS = [*SIM_ARGS, "--time-scale", "0.05"]
SCALE = "extproc_adaptive_scale_ratio"
LIMIT = "extproc_limit_concurrency"


@pytest.fixture(scope="module")
def stack() -> Any:
    local = start_stack(
        config=CONFIG,
        sim_args=STEADY_SIM_ARGS,
        with_exporter=True,
        envoy_patch=None,
    )
    try:
        yield Stack(local)
    finally:
        local.stop()


def scale(stack: Stack) -> float:
    return stack.sidecar(SCALE, pool=MODEL)


def fill_kv(stack: Stack, count: int = 6) -> list[socket.socket]:
    """Streams sent straight to the simulator (bypassing the gateway) that fill its KV cache.

    Each holds 600 prompt tokens (38 blocks) growing to 648 (41 blocks): six take 228-246 of 256 blocks,
    above the high watermark, with room left for the gateway's small requests. Each prompt starts with a word
    of its own, so the simulator's prefix cache shares none of their blocks.
    """
    host, port = stack.stack.upstream_url.removeprefix("http://").split(":")
    socks = []
    for index in range(count):
        prompt = FIRST_WORDS[index] + " hello" * 599
        body = json.dumps({"model": MODEL, "max_tokens": 48, "stream": True, "prompt": prompt}).encode()
        sock = socket.create_connection((host, int(port)), timeout=10)
        sock.sendall(
            f"POST /v1/completions HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n\r\n".encode()
            + body
        )
        socks.append(sock)
    return socks


def burst_through_gateway(stack: Stack, count: int) -> list[int]:
    """`count` concurrent requests; admitted ones are abandoned after a moment (the backend is busy)."""

    async def one(session: aiohttp.ClientSession) -> int:
        body = {
            "model": MODEL,
            "max_tokens": 20,
            "stream": True,
            "messages": [{"role": "user", "content": "hi"}],
        }
        try:
            async with session.post(f"{stack.url}/v1/chat/completions", json=body) as resp:
                return resp.status
        except (TimeoutError, aiohttp.ClientError):
            return 0  # admitted, still waiting for the busy backend's first token

    async def run() -> list[int]:
        timeout = aiohttp.ClientTimeout(total=1.5)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            return await asyncio.gather(*(one(session) for _ in range(count)))

    return asyncio.run(run())


def test_scale_follows_kv_usage_stale_feed_and_recovery(stack: Stack) -> None:
    # Fresh feed, idle backend: full limits.
    wait_for(lambda: stack.sidecar("extproc_feed_stale", pool=MODEL) == 0, 10, "feed fresh")
    wait_for(lambda: scale(stack) == 1.0, 10, "scale at 1.0")
    assert stack.sidecar(LIMIT, key=f"model:{MODEL}") == BASE_SLOTS
    idle_codes = burst_through_gateway(stack, BASE_SLOTS)
    assert idle_codes.count(429) == 0
    wait_for(lambda: stack.sidecar("extproc_active_requests") == 0, 5, "idle burst settled")

    # Drive the simulator's KV cache above the high watermark.
    socks = fill_kv(stack)
    try:
        wait_for(lambda: stack.upstream("vllm:kv_cache_usage_perc") > 0.85, 30, "KV above 85%")
        reached = wait_for(lambda: scale(stack) == pytest.approx(0.6), 5, "scale 0.6")
        assert reached <= 2.0, f"scale took {reached:.2f}s to reach 0.6"
        assert stack.sidecar(LIMIT, key=f"model:{MODEL}") == int(BASE_SLOTS * 0.6)
        rejected_before = stack.sidecar("extproc_requests_total", decision="rejected", reason="concurrency")
        codes = burst_through_gateway(stack, BASE_SLOTS)
        rejected = (
            stack.sidecar("extproc_requests_total", decision="rejected", reason="concurrency")
            - rejected_before
        )
        assert codes.count(429) == rejected
        assert rejected >= BASE_SLOTS - int(BASE_SLOTS * 0.6)
        assert stack.upstream("vllm:num_preemptions_total") == 0  # a steady cache, not a thrashing one
    finally:
        for sock in socks:
            sock.close()

    # Load removed: the backend aborts the streams, KV drains, limits come back to base.
    wait_for(lambda: stack.upstream("vllm:kv_cache_usage_perc") == 0, 10, "KV drained")
    wait_for(lambda: scale(stack) == 1.0, 10, "scale back to 1.0")
    wait_for(lambda: stack.sidecar(LIMIT, key=f"model:{MODEL}") == BASE_SLOTS, 5, "base limit")
    wait_for(lambda: stack.sidecar("extproc_active_requests") == 0, 5, "all settled")

    # Exporter gone: after stale_after_seconds the pool falls to the safe scale, never to full limits.
    stack.stack.stop_process("exporter")
    wait_for(lambda: stack.sidecar("extproc_feed_stale", pool=MODEL) == 1, 10, "feed stale")
    assert scale(stack) == pytest.approx(0.6)
    assert stack.sidecar(LIMIT, key=f"model:{MODEL}") == int(BASE_SLOTS * 0.6)

    # Exporter back: the subscriber reconnects and the scale recovers.
    stack.stack.start_exporter()
    wait_for(lambda: stack.sidecar("extproc_feed_stale", pool=MODEL) == 0, 20, "feed fresh again")
    wait_for(lambda: scale(stack) == 1.0, 10, "scale recovered")
    assert stack.sidecar("extproc_feed_reconnects_total") >= 1


def _hold_stream(stack: Stack, body: bytes) -> socket.socket:
    """A streamed request held open through the gateway once admitted (its 200 read)."""
    host, port = stack.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    sock.sendall(
        f"POST /v1/chat/completions HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n\r\n".encode()
        + body
    )
    assert b"200 OK" in sock.recv(65536)
    return sock


BUDGET_CONFIG: dict[str, Any] = {
    "models": {"*": {"context_window": 2048, "default_max_tokens": 256}},
    "limits": {"models": {MODEL: {"max_concurrency": BASE_SLOTS}}},
    "kv_budget": {"enabled": True, "target_utilization": 0.9},
}


def _headroom_is_target_less_booked(stack: Stack) -> bool:
    """One scrape: booked within the two streams' footprints, and headroom the 90 % target less booked."""
    samples = scrape(f"{stack.stack.admin_url}/metrics")
    pool = (("pool", MODEL),)
    booked = samples[("extproc_kv_booked_tokens", pool)]
    assert 2900 <= booked <= 3686
    return samples[("extproc_kv_headroom_tokens", pool)] == int(4096 * 0.9) - booked


@pytest.mark.parametrize("profile", PROFILES)
def test_kv_budget_refuses_what_the_cache_cannot_hold(profile: str) -> None:
    """256 blocks x 16 = 4,096 KV tokens; 90% target = 3,686: two 1,500-token streams fit, a third not."""
    local = start_stack(
        config=BUDGET_CONFIG,
        sim_args=SIM_ARGS,
        with_exporter=True,
        profile=profile,
        envoy_patch=None,
    )
    stack = Stack(local)
    socks: list[socket.socket] = []
    try:
        wait_for(
            lambda: stack.sidecar("extproc_kv_capacity_tokens", pool=MODEL) == 4096, 10, "capacity known"
        )
        body = json.dumps(
            {
                "model": MODEL,
                "max_tokens": 1500,
                "stream": True,
                "messages": [{"role": "user", "content": "go"}],
            }
        ).encode()
        socks.extend(_hold_stream(stack, body) for _ in range(2))
        demand = stack.sidecar("extproc_kv_demand_tokens", pool=MODEL)
        assert 3000 <= demand <= 3100
        # Booked by forecast: both streams grow to their whole allowance (no tenant history yet), so the
        # peak is their lifetime footprints, plus any KV the engine holds beyond them.
        assert stack.sidecar("extproc_kv_forecasting", pool=MODEL) == 1
        # Booked and headroom move with each engine sample: read them from one scrape, and retry a scrape
        # that landed between the two gauges' updates.
        wait_for(lambda: _headroom_is_target_less_booked(stack), 5, "headroom = target - booked")

        async def third() -> tuple[int, dict[str, str], Any]:
            async with (
                aiohttp.ClientSession() as session,
                session.post(
                    f"{stack.url}/v1/chat/completions",
                    data=body,
                    headers={"content-type": "application/json"},
                ) as resp,
            ):
                return resp.status, dict(resp.headers), await resp.json()

        status, headers, error = asyncio.run(third())
        assert status == 429
        assert headers["x-extproc-reject-reason"] == "kv_budget"
        assert error["error"]["code"] == "rate_limit_exceeded"
        assert stack.sidecar("extproc_requests_total", decision="rejected", reason="kv_budget") == 1
        # The refused request claims its KV from other tenants (fair shares, docs/tenants.md); inside its own
        # tenant admission stays first come: a small request still fits in the remaining headroom.
        claimed = "extproc_kv_claimed_tokens"  # published at the next feed sample
        wait_for(lambda: stack.sidecar(claimed, pool=MODEL) >= 1500, 5, "the claim shown")
        small = {"model": MODEL, "max_tokens": 50, "messages": [{"role": "user", "content": "hi"}]}
        assert http("POST", f"{stack.url}/v1/chat/completions", small).status == 200
    finally:
        for sock in socks:
            sock.close()
        wait_for(lambda: stack.sidecar("extproc_kv_demand_tokens", pool=MODEL) == 0, 5, "demand released")
        local.stop()


QUEUED_BUDGET_CONFIG: dict[str, Any] = {
    **BUDGET_CONFIG,
    "classes": [{"name": "standard", "queue": {"max_wait_seconds": 20}}],
    "default_class": "standard",
}


def test_a_class_that_queues_waits_for_kv_and_is_admitted_when_it_frees() -> None:
    """Two 1,500-token streams held, a third request of 800 does not fit the 3,686-token target: its class may
    queue, so it waits (no 429, no retry-after for the client to guess) and is admitted once one of the two
    held streams ends. Lean profile: with no pace learned yet it books the held streams whole, so the third
    waits whatever the host's speed (inline, the streams' progress is seen, and the forecast may rightly admit
    the third at once when they are far enough along; the wait itself is the decision's, the same in both,
    tests/unit/kvfeed/test_budget_admission.py)."""
    profile = "lean"
    local = start_stack(
        config=QUEUED_BUDGET_CONFIG, sim_args=SIM_ARGS, with_exporter=True, profile=profile, envoy_patch=None
    )
    stack = Stack(local)
    socks: list[socket.socket] = []
    try:
        wait_for(
            lambda: stack.sidecar("extproc_kv_capacity_tokens", pool=MODEL) == 4096, 10, "capacity known"
        )
        body = {
            "model": MODEL,
            "max_tokens": 1500,
            "stream": True,
            "messages": [{"role": "user", "content": "go"}],
        }
        socks.extend(_hold_stream(stack, json.dumps(body).encode()) for _ in range(2))
        with futures.ThreadPoolExecutor(1) as pool:
            third = pool.submit(
                http, "POST", f"{stack.url}/v1/chat/completions", {**body, "stream": False, "max_tokens": 800}
            )
            wait_for(
                lambda: stack.sidecar("extproc_queue_depth", **{"class": "standard"}) == 1, 10, "waiting"
            )
            assert not third.done()
            socks.pop().close()  # one held stream ends: its KV frees
            reply = third.result(timeout=20)
        assert reply.status == 200, reply
        assert stack.sidecar("extproc_requests_total", decision="rejected", reason="kv_budget") == 0
    finally:
        for sock in socks:
            sock.close()
        wait_for(lambda: stack.sidecar("extproc_kv_demand_tokens", pool=MODEL) == 0, 10, "demand released")
        local.stop()


@pytest.mark.parametrize("profile", PROFILES)
def test_forty_early_stops_do_not_train_the_next_booking_below_its_floor(profile: str) -> None:
    """Forty answers that stop after 1 of 1,500 allowed tokens teach the tenant's expected completion down,
    never below the floor: the next 1,500-token request is booked its prompt plus a tenth of its allowance
    (`KvBudget(min_completion_ratio=0.1)`), not nothing. Before the forty it is booked its whole allowance.
    The tenant's credit below its allowances is unbounded here (`unconfirmed_share` 1): its bound, which
    would book this request at 1,500 less a tenth of the 4,096-token cache, is test_poison_e2e.py's."""
    config = {**BUDGET_CONFIG, "kv_budget": {**BUDGET_CONFIG["kv_budget"], "unconfirmed_share": 1.0}}
    local = start_stack(
        config=config, sim_args=SIM_ARGS, with_exporter=True, profile=profile, envoy_patch=None
    )
    stack = Stack(local)
    body = {"model": MODEL, "max_tokens": 1500, "messages": [{"role": "user", "content": "go"}]}
    streamed = json.dumps({**body, "stream": True}).encode()
    demand = "extproc_kv_demand_tokens"
    try:
        wait_for(lambda: stack.sidecar("extproc_kv_capacity_tokens", pool=MODEL) == 4096, 10, "capacity")
        sock = _hold_stream(stack, streamed)
        untrained = stack.sidecar(demand, pool=MODEL)
        sock.close()
        wait_for(lambda: stack.sidecar(demand, pool=MODEL) == 0, 10, "first request settled")
        for _ in range(40):
            reply = http("POST", f"{stack.url}/v1/chat/completions", body, {"x-sim-output-tokens": "1"})
            assert reply.status == 200 and reply.json()["usage"]["completion_tokens"] == 1
        wait_for(lambda: stack.sidecar(demand, pool=MODEL) == 0, 10, "early stops settled")
        sock = _hold_stream(stack, streamed)
        trained = stack.sidecar(demand, pool=MODEL)
        sock.close()
        prompt = untrained - 1500
        assert 0 < prompt < 50, untrained
        assert trained == prompt + 150, (untrained, trained)
    finally:
        local.stop()


def test_a_config_that_names_no_model_still_books_the_engines_pool() -> None:
    """`models."*"` alone: every requested name shares the `*` limits, yet the feed reports the engine's
    model by name, and its KV budget books the request (it once looked for a budget of pool `*`, found none,
    and admitted everything)."""
    config = {"models": {"*": {"context_window": 2048}}, "kv_budget": {"enabled": True}}
    local = start_stack(
        config=config, sim_args=SIM_ARGS, with_exporter=True, profile="lean", envoy_patch=None
    )
    stack = Stack(local)
    body = {
        "model": MODEL,
        "max_tokens": 1500,
        "stream": True,
        "messages": [{"role": "user", "content": "go"}],
    }
    try:
        wait_for(lambda: stack.sidecar("extproc_kv_capacity_tokens", pool=MODEL) == 4096, 10, "capacity")
        sock = _hold_stream(stack, json.dumps(body).encode())
        assert 1500 < stack.sidecar("extproc_kv_demand_tokens", pool=MODEL) < 1600
        sock.close()
    finally:
        local.stop()


class FakeFeed:
    """A KvFeed server in this process streaming, every 0.1 s, whatever `samples` holds now: a stand-in for
    an exporter (or anything speaking the protocol) that sends readings no server can have."""

    def __init__(self) -> None:
        self.samples: dict[str, dict[str, Any]] = {}
        self._stop = threading.Event()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        feedback_pb2_grpc.add_KvFeedServicer_to_server(self, self._server)  # type: ignore[no-untyped-call]
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self._server.start()

    def Watch(self, request: Any, context: grpc.ServicerContext) -> Iterator[feedback_pb2.KvSample]:
        while not self._stop.is_set() and context.is_active():
            for endpoint, fields in list(self.samples.items()):
                msg = feedback_pb2.KvSample(node="gpu-1", endpoint=endpoint, model=MODEL, up=True, **fields)
                msg.sample_time.FromNanoseconds(time.time_ns())
                yield msg
            self._stop.wait(0.1)

    def stop(self) -> None:
        self._stop.set()
        self._server.stop(grace=1).wait(5)


def test_impossible_feed_values_are_missing_samples_not_readings() -> None:
    """NaN on endpoint A beside 0.95 on B: the pool reads B, scale 0.6 (the fault run saw NaN and 1.0); with
    nothing plausible left (usage -0.5, a capacity of 2^64 - 1) the pool is stale at the safe scale and the
    KV budget keeps its last real capacity (the fault run saw a headroom of 7.4e18)."""
    feed = FakeFeed()
    config = {
        **CONFIG,
        "feedback": {"exporters": [f"127.0.0.1:{feed.port}"]},
        "kv_budget": {"enabled": True, "target_utilization": 0.9},
        # The watermarks this suite's scale steps are written for (beside a budget: 0.92 / 0.98 by default).
        "adaptive": {**CONFIG["adaptive"], "low_watermark": 0.7, "high_watermark": 0.85},
    }
    local = build_stack(config=config, sim_args=SIM_ARGS, envoy_patch=None)
    cap = 4096
    try:
        feed.samples = {
            "10.0.0.1:8000": {"kv_usage": 0.1, "kv_capacity_tokens": cap},
            "10.0.0.2:8000": {"kv_usage": 0.1, "kv_capacity_tokens": cap},
        }
        local.start()
        stack = Stack(local)
        wait_for(lambda: scale(stack) == 1.0, 20, "scale at 1.0")
        assert stack.sidecar("extproc_kv_capacity_tokens", pool=MODEL) == 2 * cap

        feed.samples = {
            "10.0.0.1:8000": {"kv_usage": math.nan, "kv_capacity_tokens": cap},
            "10.0.0.2:8000": {"kv_usage": 0.95, "kv_capacity_tokens": cap},
        }
        wait_for(lambda: scale(stack) == pytest.approx(0.6), 5, "scale 0.6 from endpoint B")
        assert stack.sidecar("extproc_kv_usage_ratio", pool=MODEL) == pytest.approx(0.95)
        assert stack.sidecar("extproc_feed_stale", pool=MODEL) == 0
        assert stack.sidecar(LIMIT, key=f"model:{MODEL}") == int(BASE_SLOTS * 0.6)
        assert stack.sidecar("extproc_kv_capacity_tokens", pool=MODEL) == cap  # B's alone
        assert stack.sidecar("extproc_feed_invalid_samples_total", field="kv_usage") >= 1

        feed.samples = {
            "10.0.0.1:8000": {"kv_usage": 0.1, "kv_capacity_tokens": 2**64 - 1},
            "10.0.0.2:8000": {"kv_usage": -0.5, "kv_capacity_tokens": cap},
        }
        wait_for(lambda: stack.sidecar("extproc_feed_stale", pool=MODEL) == 1, 5, "pool stale")
        assert scale(stack) == pytest.approx(0.6)
        assert stack.sidecar("extproc_feed_invalid_samples_total", field="kv_capacity_tokens") >= 1
        headroom = stack.sidecar("extproc_kv_headroom_tokens", pool=MODEL)
        assert headroom <= cap * 0.9, headroom
        # The gateway still answers, at the safe limits.
        reply = http(
            "POST",
            f"{stack.url}/v1/chat/completions",
            {"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]},
        )
        assert reply.status == 200, reply.body
    finally:
        local.stop()
        feed.stop()


ALIAS = "meta-llama/Meta-Llama-3-8B-Instruct"
ADAPTER = "sql-lora"
SERVED_CONFIG: dict[str, Any] = {
    "models": {"*": {"context_window": 2048, "default_max_tokens": 256}},
    "limits": {"models": {MODEL: {"max_concurrency": 2}}},
    "adaptive": {"recovery_per_second": 1.0, "stale_after_seconds": 2.0},
}
# A 50 ms decode step: a 200-token answer streams for 10 s, holding its slot while the test looks.
SERVED_SIM_ARGS = [
    *fixed_step_sim(MODEL, 50, "--num-gpu-blocks", "256", "--max-model-len", "2048"),
    *("--served-model-alias", ALIAS, "--lora-adapter", ADAPTER),
]


def open_stream(stack: Stack, model: str) -> tuple[socket.socket, bytes]:
    """A streamed chat request through Envoy, left open; its first bytes (status line and headers)."""
    host, port = stack.url.removeprefix("http://").split(":")
    body = json.dumps(
        {"model": model, "max_tokens": 200, "stream": True, "messages": [{"role": "user", "content": "go"}]}
    ).encode()
    sock = socket.create_connection((host, int(port)), timeout=10)
    sock.sendall(
        f"POST /v1/chat/completions HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n\r\n".encode()
        + body
    )
    return sock, sock.recv(65536)


@pytest.mark.parametrize("profile", PROFILES)
def test_engine_served_aliases_and_adapters_share_the_base_limit_and_unserved_names_are_refused(
    profile: str,
) -> None:
    """The simulator serves `llama-3-8b` also as a --served-model-name alias and a LoRA adapter, listed at
    /v1/models as vLLM 0.32 lists them. The config names only the base model's 2-slot limit: a stream through
    the alias and one through the adapter take both slots, so a third request by the base name is refused;
    a name the engine does not serve is refused by the gateway without reaching the engine."""
    local = start_stack(
        config=SERVED_CONFIG,
        sim_args=SERVED_SIM_ARGS,
        with_exporter=True,
        profile=profile,
        envoy_patch=None,
    )
    stack = Stack(local)
    socks: list[socket.socket] = []
    try:
        wait_for(lambda: scale(stack) == 1.0, 20, "fresh feed, scale at 1.0")
        assert stack.sidecar(LIMIT, key=f"model:{MODEL}") == 2
        for model in (ALIAS, ADAPTER):
            sock, head = open_stream(stack, model)
            socks.append(sock)
            assert b" 200 " in head.split(b"\r\n", 1)[0], head[:200]
        chat = {"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
        third = http("POST", f"{stack.url}/v1/chat/completions", chat)
        assert third.status == 429, third.body
        assert third.headers["x-extproc-reject-reason"] == "concurrency"

        reached = stack.upstream_requests()
        unserved = http("POST", f"{stack.url}/v1/chat/completions", {**chat, "model": "gpt-4"})
        assert unserved.status == 404, unserved.body
        error = unserved.json()["error"]
        assert (error["code"], error["param"]) == ("model_not_found", "model")
        assert error["message"] == "The model `gpt-4` does not exist."
        assert stack.upstream_requests() == reached  # refused at the gateway, not by the engine
    finally:
        for sock in socks:
            sock.close()
        local.stop()
