"""What only the lean profile has to prove, through the real Envoy, sidecar and simulator: a lease whose end
report never comes expires by the documented rule and is counted, and a class is cut under KV pressure with
no response chunk passing through the sidecar (the inline profile's cut runs here too, for comparison).

The rest of the lean profile (exact settlement with the SDKs, hidden usage, disconnects, crashes, 503s, every
API) runs in the modules parametrized over both profiles (tests/e2e/conftest.py `profile`).
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import openai
import pytest

from devstack.envoy import trust_client_tenant_header
from devstack.processes import Ports
from extproc.envoyconf.bootstrap import http_connection_managers
from extproc.envoyconf.profiles import PROFILES
from tests.support.ledger import Ledger, prompt_byte_bound
from tests.support.stack import Stack, fixed_step_sim, http, start_stack

pytestmark = pytest.mark.e2e

MODEL = "llama-3-8b"
REPORT_WAIT_S = 1.0
MESSAGES: Any = [{"role": "user", "content": "Tell me everything."}]


def report_to_nowhere(config: dict[str, Any]) -> None:
    """Point the access logger at a port nobody listens on: Envoy drops the entries, as when the sidecar's
    end-report service is down while its ext_proc service is up."""
    dead = Ports.free().grpc
    clusters = config["static_resources"]["clusters"]
    sidecar = next(c for c in clusters if c["name"] == "llm_admission_extproc")
    nowhere = json.loads(json.dumps(sidecar))
    nowhere["name"] = "nowhere"
    nowhere["load_assignment"]["cluster_name"] = "nowhere"
    address = nowhere["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]
    address["socket_address"]["port_value"] = dead
    clusters.append(nowhere)
    for listener in config["static_resources"]["listeners"]:
        hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
        for logger in hcm["access_log"]:
            if logger["name"] == "envoy.access_loggers.http_grpc":
                logger["typed_config"]["common_config"]["grpc_service"]["envoy_grpc"]["cluster_name"] = (
                    "nowhere"
                )


def lean_stack(config: dict[str, Any], envoy_patch: Callable[[dict[str, Any]], None]) -> Iterator[Stack]:
    """A lean stack over a steady simulator (5 ms steps) with `envoy_patch` applied, stopped after use."""
    local = start_stack(
        config=config, sim_args=fixed_step_sim(MODEL, 5), envoy_patch=envoy_patch, profile="lean"
    )
    try:
        yield Stack(local)
    finally:
        local.stop()


@pytest.fixture(scope="module")
def lost_reports() -> Iterator[Stack]:
    config = {
        "admission": {"end_report_wait_seconds": REPORT_WAIT_S, "assumed_decode_tokens_per_second": 50},
        "models": {"*": {"context_window": 4096, "default_max_tokens": 256}},
    }
    yield from lean_stack(config, report_to_nowhere)


def test_a_lease_whose_end_report_never_comes_expires_by_the_rule_and_is_counted(lost_reports: Stack) -> None:
    stack = lost_reports
    before = Ledger.read(stack)
    with openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0) as client:
        chunks = list(
            client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=20, stream=True)
        )
    ended = time.monotonic()
    assert chunks
    while stack.sidecar("extproc_active_requests") != 0:
        assert time.monotonic() - ended < REPORT_WAIT_S + 10, "lease never expired"
        time.sleep(0.02)
    waited = time.monotonic() - ended
    # The bound starts when the request ends on Envoy, which the client sees at about the same moment.
    assert waited >= REPORT_WAIT_S * 0.8
    assert stack.sidecar("extproc_settlements_total", outcome="expired") == 1
    assert stack.sidecar("extproc_end_reports_total", result="matched") == 0
    delta = Ledger.read(stack) - before
    # Charged the prompt and the decode-rate estimate of what was generated unseen: at most the reservation.
    assert delta.reserved == prompt_byte_bound(MESSAGES, 8, 32) + 20  # admitted on the byte bound
    assert 0 < delta.completion <= 20
    assert delta.refunded == delta.reserved - (delta.prompt + delta.completion)


# ------------------------------------------------------------------------------------------------------------
# Cut under KV pressure

CUT_AT = 0.5
CUT_CONFIG: dict[str, Any] = {
    "models": {"*": {"context_window": 2048, "default_max_tokens": 256}},
    "limits": {"models": {MODEL: {"max_concurrency": 16}}},  # the pool the KV feed reports on
    "classes": [{"name": "online"}, {"name": "batch", "cut_streams_above_kv": CUT_AT}],
    "default_class": "online",
    "tenants": {"nightly": {"class": "batch"}},
    "admission": {"tenant": {"header": "x-tenant"}},
    "adaptive": {"recovery_per_second": 1.0},
}
# 256 blocks of 16 tokens; a decode step of 20 ms: a 1,500-token answer streams for 30 s unless cut.
CUT_SIM_ARGS = fixed_step_sim(MODEL, 20, "--num-gpu-blocks", "256", "--max-model-len", "2048")


def fill_kv(stack: Stack, count: int) -> list[socket.socket]:
    """Streams straight to the simulator (past the gateway), 600 prompt tokens (38 blocks) each."""
    host, port = stack.stack.upstream_url.removeprefix("http://").split(":")
    body = json.dumps({"model": MODEL, "max_tokens": 400, "stream": True, "prompt": " hello" * 600}).encode()
    socks = []
    for _ in range(count):
        sock = socket.create_connection((host, int(port)), timeout=10)
        sock.sendall(
            f"POST /v1/completions HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n\r\n".encode()
            + body
        )
        socks.append(sock)
    return socks


@pytest.fixture(scope="module", params=PROFILES)
def kv_stack(request: pytest.FixtureRequest) -> Iterator[Stack]:
    local = start_stack(
        config=CUT_CONFIG,
        sim_args=CUT_SIM_ARGS,
        with_exporter=True,
        profile=request.param,
    )
    try:
        yield Stack(local)
    finally:
        local.stop()


def test_a_batch_stream_is_cut_when_the_pool_passes_its_watermark(kv_stack: Stack) -> None:
    stack = kv_stack
    deadline = time.monotonic() + 15
    while stack.sidecar("extproc_feed_stale", pool=MODEL) != 0:
        assert time.monotonic() < deadline, "KV feed never fresh"
        time.sleep(0.05)
    before = Ledger.read(stack)
    received = 0
    socks: list[socket.socket] = []
    started = time.monotonic()
    with (
        openai.OpenAI(
            base_url=f"{stack.url}/v1",
            api_key="unused",
            max_retries=0,
            default_headers={"x-tenant": "nightly"},
        ) as client,
        pytest.raises(openai.APIError),
    ):
        stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1500, stream=True)
        try:
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    received += 1
                if received == 5 and not socks:
                    socks = fill_kv(stack, 4)  # 152 of 256 blocks: past the 0.5 watermark
        finally:
            for sock in socks:
                sock.close()
    cut_after = time.monotonic() - started
    assert 0 < received < 1500
    assert cut_after < 20, "the stream ran on instead of being cut"
    assert stack.sidecar("extproc_streams_cut_total", **{"class": "batch"}) == 1
    deadline = time.monotonic() + 5
    while stack.sidecar("extproc_active_requests") != 0:
        assert time.monotonic() < deadline, "cut stream never settled"
        time.sleep(0.02)
    assert stack.sidecar("extproc_settlements_total", outcome="cut") == 1
    delta = Ledger.read(stack) - before
    # Charged the prompt and what was streamed before the reset (plus what was in flight), no more.
    assert received <= delta.completion <= received + 40
    assert delta.refunded == delta.reserved - (delta.prompt + delta.completion)


# ------------------------------------------------------------------------------------------------------------
# Admitted, never forwarded

TIMEOUT_CONFIG: dict[str, Any] = {
    "admission": {"end_report_wait_seconds": REPORT_WAIT_S},
    "models": {"*": {"context_window": 4096, "default_max_tokens": 64}},
}


def tiny_message_timeout(config: dict[str, Any]) -> None:
    """The tests' tenant trust, and an ext_proc message timer of 1 ms: Envoy gives up on most admissions
    before they land, as the 1 s the shipped configs had did on a host too busy to answer in time."""
    trust_client_tenant_header(config)
    for hcm in http_connection_managers(config):
        for http_filter in hcm["http_filters"]:
            typed = http_filter.get("typed_config", {})
            if "message_timeout" in typed:
                typed["message_timeout"] = "0.001s"


@pytest.fixture(scope="module")
def timeouts() -> Iterator[Stack]:
    yield from lean_stack(TIMEOUT_CONFIG, tiny_message_timeout)


def test_admissions_envoy_timed_out_are_refunded_and_raise_no_channel_alarm(timeouts: Stack) -> None:
    """Envoy answered 504 itself when its message timer fired before the admission landed, so nothing went
    upstream: whatever the sidecar admitted for those is refunded in full, and is no sign of a lost report
    channel (three expiries in a row would say so)."""
    stack = timeouts
    before = Ledger.read(stack)
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 20}
    statuses = [http("POST", f"{stack.url}/v1/chat/completions", body).status for _ in range(20)]
    assert statuses.count(504) >= 1, statuses
    deadline = time.monotonic() + REPORT_WAIT_S + 10
    while stack.sidecar("extproc_active_requests") != 0:
        assert time.monotonic() < deadline, "a lease never settled"
        time.sleep(0.05)
    outcomes = {
        o: stack.sidecar("extproc_settlements_total", outcome=o)
        for o in ("completed", "not_forwarded", "expired", "aborted", "upstream_error")
    }
    # Envoy logs each of its 504s to the sidecar with the request's id (2 of 6 had been admitted, seen here).
    assert stack.sidecar("extproc_end_reports_total", result="ext_proc_failed") == statuses.count(504)
    assert outcomes["completed"] == statuses.count(200), outcomes
    assert outcomes["expired"] == outcomes["aborted"] == outcomes["upstream_error"] == 0, outcomes
    assert stack.sidecar("extproc_end_report_channel_up") == 1
    assert stack.sidecar("extproc_end_report_channel_losses_total") == 0
    delta = Ledger.read(stack) - before
    # Only what the engine answered is charged: nothing for the admissions Envoy never forwarded.
    assert delta.refunded == delta.reserved - (delta.prompt + delta.completion)
    if outcomes["completed"] == 0:
        assert delta.prompt == delta.completion == 0
