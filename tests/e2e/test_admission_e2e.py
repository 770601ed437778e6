"""The admission path through a real Envoy 1.40, the sidecar and the simulator streaming slowly."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from typing import Any

import aiohttp
import pytest

from tests.support.stack import Reply, Stack, fixed_step_sim, http

MODEL = "llama-3-8b"
CONFIG: dict[str, Any] = {
    "admission": {"max_body_bytes": 65536, "tenant": {"header": "x-tenant"}},
    "models": {"*": {"context_window": 8192, "default_max_tokens": 256}},
    "limits": {
        "models": {MODEL: {"max_concurrency": 8}},
        "tenants": {"metered": {"tokens_per_minute": 20000}},
    },
}
# A decode step of 10 ms regardless of batch size: a 200-token answer streams for about two seconds.
SIM_ARGS = fixed_step_sim(MODEL, 10)


def chat(max_tokens: int, stream: bool = False, content: str = "Tell me a story.") -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": content}],
    }
    if stream:
        body["stream"] = True
    return body


@pytest.fixture(scope="module")
def stack(make_stack: Any) -> Stack:
    s: Stack = make_stack(CONFIG, SIM_ARGS)
    return s


def wait_until(check: Any, limit_s: float, what: str) -> float:
    start = time.monotonic()
    while time.monotonic() - start < limit_s:
        if check():
            return time.monotonic() - start
        time.sleep(0.02)
    raise AssertionError(f"{what} not reached within {limit_s}s")


def accounting_balances(stack: Stack) -> None:
    """Every reserved token is either charged or refunded: nothing leaked, nothing counted twice."""
    reserved = stack.sidecar("extproc_tokens_reserved_total")
    refunded = stack.sidecar("extproc_tokens_refunded_total")
    overrun = stack.sidecar("extproc_tokens_overrun_total")
    settled = stack.sidecar("extproc_tokens_settled_total")
    assert reserved - refunded + overrun == settled


def test_twenty_concurrent_long_requests_against_eight_slots(stack: Stack) -> None:
    before = stack.upstream_requests()

    async def one(client: aiohttp.ClientSession) -> Reply:
        async with client.post(f"{stack.url}/v1/chat/completions", json=chat(200)) as resp:
            return Reply(resp.status, {k.lower(): v for k, v in resp.headers.items()}, await resp.read())

    async def burst() -> list[Reply]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as client:
            return await asyncio.gather(*(one(client) for _ in range(20)))

    responses = asyncio.run(burst())
    codes = sorted(r.status for r in responses)
    assert codes.count(200) == 8, codes
    assert codes.count(429) == 12, codes
    for r in responses:
        if r.status == 429:
            assert int(r.headers["retry-after"]) >= 1
            assert r.headers["x-ratelimit-remaining-requests"] == "0"
            assert r.headers["x-ratelimit-limit-requests"] == "8"
            error = r.json()["error"]
            assert error["code"] == "rate_limit_exceeded"
        else:
            assert r.headers["x-ratelimit-limit-requests"] == "8"
            assert r.json()["usage"]["completion_tokens"] == 200
    assert stack.upstream_requests() - before == 8
    assert stack.sidecar("extproc_active_requests") == 0
    assert stack.sidecar("extproc_key_active_requests", key=f"model:{MODEL}") == 0
    accounting_balances(stack)


def test_body_over_the_cap_is_413_and_never_reaches_the_upstream(stack: Stack) -> None:
    before = stack.upstream("vllm:prompt_tokens_total")
    requests_before = stack.upstream_requests()
    big = chat(10, content="x" * 70_000)
    r = http("POST", f"{stack.url}/v1/chat/completions", big)
    assert r.status == 413
    assert r.json()["error"]["code"] == "request_too_large"
    # Chunked, without content-length: the sidecar's body check answers instead of the header check.
    payload = json.dumps(big).encode()

    host, port = stack.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(
            f"POST /v1/chat/completions HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
            "transfer-encoding: chunked\r\n\r\n".encode()
        )
        for i in range(0, len(payload), 8192):
            part = payload[i : i + 8192]
            sock.sendall(f"{len(part):x}\r\n".encode() + part + b"\r\n")
        sock.sendall(b"0\r\n\r\n")
        answer = sock.recv(65536)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert stack.upstream("vllm:prompt_tokens_total") == before
    assert stack.upstream_requests() == requests_before


def test_context_overflow_is_400_and_never_reaches_the_upstream(stack: Stack) -> None:
    before = stack.upstream_requests()
    r = http("POST", f"{stack.url}/v1/chat/completions", chat(8190))
    assert r.status == 400
    error = r.json()["error"]
    assert error["code"] == "context_length_exceeded"
    assert error["param"] == "max_tokens"
    r = http("POST", f"{stack.url}/v1/chat/completions", raw=b'{"model": 3}')
    assert r.status == 400
    assert r.json()["error"]["param"] == "model"
    assert stack.upstream_requests() == before


def test_models_listing_passes_through_untouched(stack: Stack) -> None:
    r = http("GET", f"{stack.url}/v1/models")
    assert r.status == 200
    assert r.json()["data"][0]["id"] == MODEL
    assert "x-ratelimit-limit-requests" not in r.headers


def _open_stream(stack: Stack, body: dict[str, Any], tenant: str | None = None) -> socket.socket:
    """A raw HTTP/1.1 streaming request, so the test decides exactly when the client goes away."""
    host, port = stack.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    payload = json.dumps(body).encode()
    extra = f"x-tenant: {tenant}\r\n" if tenant else ""
    sock.sendall(
        (
            f"POST /v1/chat/completions HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(payload)}\r\n{extra}\r\n"
        ).encode()
        + payload
    )
    return sock


def _read_events(sock: socket.socket, count: int) -> bytes:
    data = b""
    while data.count(b"data: ") < count:
        chunk = sock.recv(65536)
        assert chunk, "stream ended early"
        data += chunk
    return data


def test_client_disconnect_mid_stream_frees_slot_and_refunds(stack: Stack) -> None:
    assert stack.sidecar("extproc_active_requests") == 0
    aborted_before = stack.sidecar("extproc_settlements_total", outcome="aborted")
    sock = _open_stream(stack, chat(2000, stream=True))
    head = _read_events(sock, 3)
    assert b"200 OK" in head
    assert stack.sidecar("extproc_active_requests") == 1
    sock.close()
    waited = wait_until(lambda: stack.sidecar("extproc_active_requests") == 0, 1.0, "slot released")
    assert waited < 1.0
    # The simulator aborted the sequence too: its KV blocks are free again.
    wait_until(lambda: stack.upstream("vllm:num_requests_running") == 0, 2.0, "backend abort")
    assert stack.upstream("vllm:kv_cache_usage_perc") == 0
    assert stack.sidecar("extproc_settlements_total", outcome="aborted") == aborted_before + 1
    accounting_balances(stack)


def test_tpm_exhausted_then_admitted_after_refill(stack: Stack) -> None:
    """20,000 TPM (333/s): two long streams hold 14,000+ tokens, a third 7,000-token request must wait."""
    held = [_open_stream(stack, chat(7000, stream=True), tenant="metered") for _ in range(2)]
    for sock in held:
        _read_events(sock, 1)
    r = http("POST", f"{stack.url}/v1/chat/completions", chat(7000), headers={"x-tenant": "metered"})
    assert r.status == 429
    assert r.headers["x-extproc-reject-reason"] == "tokens"
    assert r.json()["error"]["type"] == "tokens"
    wait_s = int(r.headers["retry-after-ms"]) / 1000
    assert 1 < wait_s < 10
    remaining = int(r.headers["x-ratelimit-remaining-tokens"])
    assert remaining < 7000
    time.sleep(wait_s + 0.2)
    sock = _open_stream(stack, chat(7000, stream=True), tenant="metered")
    assert b"200 OK" in _read_events(sock, 1)
    for s in [*held, sock]:
        s.close()
    wait_until(lambda: stack.sidecar("extproc_active_requests") == 0, 2.0, "all streams settled")
    accounting_balances(stack)
    # The bucket is where arithmetic puts it: capacity minus what the three streams really used, plus refill.
    available = stack.sidecar("extproc_tokens_available", key="tenant:metered")
    assert available <= 20000
    assert stack.sidecar("extproc_key_active_requests", key="tenant:metered") == 0


@pytest.mark.parametrize(
    "path", ["/v1/%63hat/completions", "/v1/chat%2Fcompletions", "//v1//chat/completions"]
)
def test_escaped_or_doubled_paths_are_still_admitted(stack: Stack, path: str) -> None:
    """Spellings the backend would serve go through admission too (Envoy normalizes, the sidecar too)."""
    before = stack.upstream_requests()
    r = http("POST", f"{stack.url}{path}", chat(8190))
    assert r.status == 400, (r.status, r.body[:200])
    assert r.json()["error"]["code"] == "context_length_exceeded"
    assert stack.upstream_requests() == before
