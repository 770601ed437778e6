"""A lease's end when the usual signals fail, and what Envoy answers itself, through a real Envoy.

* The sidecar down: Envoy's ext_proc filter fails closed; the client gets a retryable 503 with a retry hint
  in OpenAI JSON, not a bare 500 (envoy/envoy.yaml, local_reply_config).
* The lean profile's end-report channel lost (the access log cut by a relay while ext_proc works; Envoy killed
  with streams open): detected and shown, each slot freed when its request ends instead of after
  `end_report_wait_seconds`, the charge from the time to the stream's end x the learned decode rate, within
  1.5x of what the engine generated.
* A slow reader (a raw socket reading 1 KiB every 0.1 s of a 24 x 2,000-token answer): the metered route's
  lifetime bound (`admission.max_request_seconds`) ends it, and it pays for what the engine generated. With
  the KV feed its slot goes back once the engine is done, before the client has read the answer: a second
  request is admitted into a one-slot limit while the first one's client still reads.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import re
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import openai
import pytest

from devstack.envoy import trust_client_tenant_header
from devstack.processes import Ports, free_port
from devstack.stack import LocalStack
from extproc.admission.replies import refusals
from extproc.config import AdmissionConfig
from extproc.envoyconf.bootstrap import http_connection_managers
from extproc.envoyconf.lean import DRAIN_BODY_BYTES
from tests.support.stack import (
    build_stack,
    end_reports_to,
    fixed_step_sim,
    http,
    metric,
    slow_reader_post,
    start_stack,
    streamed_usage,
    wait_fed,
)

MODEL = "llama-3-8b"
CONFIG: dict[str, Any] = {
    "models": {"*": {"context_window": 4096, "default_max_tokens": 256}},
    "limits": {"global": {"tokens_per_minute": 10_000_000}},
}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8}


@pytest.fixture
def lone_stack(request: pytest.FixtureRequest) -> Iterator[LocalStack]:
    """A stack of its own for a test that breaks it (stops a process, cuts a channel)."""
    profile, config, sim_args = request.param
    stack = start_stack(config, sim_args, profile)
    try:
        yield stack
    finally:
        stack.stop()


@pytest.mark.parametrize(
    "lone_stack",
    [(profile, CONFIG, fixed_step_sim(MODEL, 5)) for profile in ("inline", "lean")],
    indirect=True,
    ids=["inline", "lean"],
)
def test_sidecar_down_is_a_retryable_503_in_openai_json(lone_stack: LocalStack) -> None:
    url = f"{lone_stack.envoy_url}/v1/chat/completions"
    assert http("POST", url, CHAT).status == 200
    lone_stack.stop_process("sidecar")
    reply = http("POST", url, CHAT)
    assert reply.status == 503, reply.body
    assert reply.headers["retry-after"] == "1"
    assert reply.headers["retry-after-ms"] == "1000"
    assert reply.headers["content-type"].startswith("application/json")
    error = reply.json()["error"]
    assert error["type"] == "server_error" and error["code"] == "service_unavailable"
    assert "try again" in error["message"]
    # Nothing reached the backend: the simulator counted one request, the one before the sidecar stopped.
    assert metric(f"{lone_stack.upstream_url}/metrics", "vllm:request_success_total") == 1


# ------------------------------------------------------------------------------------------------------------
# The end-report channel lost (lean profile): Envoy's access log to the sidecar broken while ext_proc works.


class Relay:
    """A TCP relay in front of the sidecar's gRPC port for Envoy's access log only: `cut()` breaks that
    channel (listener and open connections closed, new ones refused) while ext_proc keeps its own path."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.port = free_port()
        self._listener: socket.socket | None = None
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()

    def start(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(16)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target))
            with self._lock:
                self._conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                dst.sendall(data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def cut(self) -> None:
        if self._listener is not None:
            # shutdown() wakes the thread blocked in accept() (Linux); close() alone leaves it listening.
            with contextlib.suppress(OSError):
                self._listener.shutdown(socket.SHUT_RDWR)
            self._listener.close()
            self._listener = None
        with self._lock:
            conns, self._conns = self._conns, []
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
            conn.close()


def via_relay(relay: Relay) -> Callable[[dict[str, Any]], None]:
    """An Envoy patch: the end-report logger talks to the sidecar through `relay`, ext_proc directly."""
    return end_reports_to(relay.port, "end_report_relay")


STEP_MS = 50  # 20 tokens/s per sequence, about the pace the fault suite measured on its engine
CHANNEL_CONFIG: dict[str, Any] = {
    "models": {"*": {"context_window": 4096, "default_max_tokens": 256}},
    "limits": {"global": {"tokens_per_minute": 10_000_000, "max_concurrency": 4}},
    "admission": {"end_report_wait_seconds": 5},
}


@pytest.fixture
def relayed() -> Iterator[tuple[LocalStack, Relay]]:
    ports = Ports.free()
    relay = Relay(ports.grpc)
    relay.start()
    stack = build_stack(
        ports=ports,
        config=CHANNEL_CONFIG,
        sim_args=fixed_step_sim(MODEL, STEP_MS),
        envoy_patch=via_relay(relay),
        profile="lean",
    )
    try:
        stack.start()
        yield stack, relay
    finally:
        stack.stop()
        relay.cut()


def stream_chat(url: str, max_tokens: int) -> int:
    """One streamed chat completion read to its end; the completion tokens its usage reports."""
    return streamed_usage(url, MODEL, max_tokens, {"ignore_eos": True}) or 0


def sidecar_metric(stack: LocalStack, name: str, **labels: str) -> float:
    return metric(f"{stack.admin_url}/metrics", name, **labels)


def wait_for(check: Callable[[], bool], timeout_s: float) -> float:
    """Seconds until `check()` held (bounded loop); raises past `timeout_s`."""
    started = time.monotonic()
    while not check():
        if time.monotonic() - started > timeout_s:
            raise TimeoutError(f"not reached in {timeout_s}s")
        time.sleep(0.05)
    return time.monotonic() - started


def test_lost_end_report_channel_is_detected_released_at_the_end_and_charged_near_the_truth(
    relayed: tuple[LocalStack, Relay],
) -> None:
    stack, relay = relayed
    completion = functools.partial(sidecar_metric, stack, "extproc_tokens_settled_total", kind="completion")
    # The channel works: completed streams teach the pool's decode rate.
    for _ in range(3):
        assert stream_chat(stack.envoy_url, 40) == 40
    wait_for(lambda: sidecar_metric(stack, "extproc_active_requests") == 0, 5)
    assert sidecar_metric(stack, "extproc_end_reports_total", result="matched") == 3
    assert sidecar_metric(stack, "extproc_end_report_channel_up") == 1

    relay.cut()
    before = completion()
    truth = 0
    released_after: list[float] = []
    for _ in range(6):
        truth += stream_chat(stack.envoy_url, 40)
        released_after.append(wait_for(lambda: sidecar_metric(stack, "extproc_active_requests") == 0, 10))
    wait_for(lambda: sidecar_metric(stack, "extproc_settlements_total", outcome="expired") == 6, 10)
    charged = completion() - before
    print(f"charged {charged} for {truth} generated; released after {released_after}")
    # Shown: the gauge, the log line.
    assert sidecar_metric(stack, "extproc_end_report_channel_up") == 0
    assert "end-report channel down" in stack.processes["sidecar"].log()
    # Once detected, a slot is released when its request ends, not after the 5 s wait.
    assert max(released_after) < 1.0, released_after
    # Charged from the stream's end and the learned pace: within 1.5x of what was generated.
    assert truth / 1.5 <= charged <= truth * 1.5, (charged, truth)
    # The path back: the late report of the next request proves the channel again.
    relay.start()
    assert stream_chat(stack.envoy_url, 20) == 20
    wait_for(lambda: sidecar_metric(stack, "extproc_end_report_channel_up") == 1, 5)


def test_envoy_killed_with_streams_open_frees_the_slots_at_once_and_charges_near_the_truth(
    relayed: tuple[LocalStack, Relay],
) -> None:
    stack, _relay = relayed
    generated = functools.partial(metric, f"{stack.upstream_url}/metrics", "vllm:generation_tokens_total")
    completion = functools.partial(sidecar_metric, stack, "extproc_tokens_settled_total", kind="completion")
    for _ in range(3):
        assert stream_chat(stack.envoy_url, 40) == 40
    wait_for(lambda: sidecar_metric(stack, "extproc_active_requests") == 0, 5)
    before_generated, before_charged = generated(), completion()
    streams = [threading.Thread(target=_stream_until_cut, args=(stack.envoy_url,)) for _ in range(3)]
    for thread in streams:
        thread.start()
    wait_for(lambda: sidecar_metric(stack, "extproc_active_requests") == 3, 10)
    time.sleep(2.0)  # the answers stream for a while (40 tokens each) before Envoy dies
    envoy = stack.processes.pop("envoy")
    os.killpg(envoy.popen.pid, signal.SIGKILL)
    envoy.popen.wait(5)
    killed_at = time.monotonic()
    freed_after = wait_for(lambda: sidecar_metric(stack, "extproc_active_requests") == 0, 10)
    for thread in streams:
        thread.join(10)
    time.sleep(0.5)  # the engine stops each sequence at its next step after the connection closed
    truth, charged = generated() - before_generated, completion() - before_charged
    print(f"charged {charged} for {truth} generated; freed {freed_after:.2f}s after the kill")
    assert freed_after < 1.0, time.monotonic() - killed_at
    assert sidecar_metric(stack, "extproc_end_report_channel_up") == 0
    assert truth / 1.5 <= charged <= truth * 1.5, (charged, truth)


def _stream_until_cut(url: str) -> None:
    with contextlib.suppress(Exception):  # whatever the transport raises once Envoy is gone
        stream_chat(url, 400)


# ------------------------------------------------------------------------------------------------------------
# A slow reader: a lifetime bound ends the lease, and the charge follows the engine, not the reading.

LIFETIME_S = 6
SLOW_CONFIG: dict[str, Any] = {
    "models": {"*": {"context_window": 4096, "default_max_tokens": 256}},
    "limits": {"global": {"tokens_per_minute": 100_000_000}},
    "admission": {"max_request_seconds": LIFETIME_S},
}
SLOW_SIM = fixed_step_sim(MODEL, 2, "--num-gpu-blocks", "8192", "--max-model-len", "4096")


def bound_inline_route(config: dict[str, Any]) -> None:
    """The inline template's metered route with the test's lifetime bound (the lean rendering takes it from
    `admission.max_request_seconds`)."""
    trust_client_tenant_header(config)
    for hcm in http_connection_managers(config):
        for vhost in hcm["route_config"]["virtual_hosts"]:
            for route in vhost["routes"]:
                if route["name"] == "llm":
                    route["route"]["max_stream_duration"] = {"max_stream_duration": f"{LIFETIME_S}s"}


@pytest.fixture(params=["inline", "lean"])
def slow_stack(request: pytest.FixtureRequest) -> Iterator[LocalStack]:
    """The lifetime bound, and the KV feed as shipped (the engine's own pace reaches the charge)."""
    stack = build_stack(
        config=SLOW_CONFIG,
        sim_args=SLOW_SIM,
        envoy_patch=bound_inline_route if request.param == "inline" else trust_client_tenant_header,
        profile=request.param,
        with_exporter=True,
    )
    try:
        stack.start()
        yield stack
    finally:
        stack.stop()


PACE_LESSON_TOKENS = 400
"""Each warm-up answer: 0.8 s on the 2 ms-a-step simulator. A slow reader's close is charged the larger of the
learned pace and the feed's over its time: 40-token answers (80 ms) took their delivery's jitter for the
pace on a busy host (about 160 tok/s for 500), and before the feed's pace counted, charged a slow reader
29,352 of 48,000; with the feed's, 48,000 even with no lesson at all."""


def teach_pace(stack: LocalStack) -> None:
    """Two completed streams teach the pool's decode rate; then nothing is in flight."""
    for _ in range(2):
        assert stream_chat(stack.envoy_url, PACE_LESSON_TOKENS) == PACE_LESSON_TOKENS
    wait_for(lambda: sidecar_metric(stack, "extproc_active_requests") == 0, 5)


def slots_held(stack: LocalStack) -> float:
    """The slots the sidecar holds: a lease charged by the engines' count gives its slot back at its end and
    stays open (`extproc_active_requests`) until the feed has read past that end."""
    return sidecar_metric(stack, "extproc_key_active_requests", key="global")


def test_a_slow_reader_is_bounded_and_pays_for_what_the_engine_generated(slow_stack: LocalStack) -> None:
    stack = slow_stack
    teach_pace(stack)
    generated = functools.partial(metric, f"{stack.upstream_url}/metrics", "vllm:generation_tokens_total")
    completion = functools.partial(sidecar_metric, stack, "extproc_tokens_settled_total", kind="completion")
    before_generated, before_charged = generated(), completion()
    sock = slow_reader(stack)
    read = 0
    try:
        started = time.monotonic()
        freed_at = None
        ever_held = False
        # Read 1 KiB every 0.1 s (10 KiB/s against ~10 MB of answer) until the slot is free, 20 s at most.
        while time.monotonic() - started < 20:
            chunk = sock.recv(1024)
            if not chunk:
                break
            read += len(chunk)
            held = slots_held(stack)
            ever_held = ever_held or held == 1
            if freed_at is None and held == 0:
                freed_at = time.monotonic() - started
                break
            time.sleep(0.1)
        if freed_at is None:
            freed_at = wait_for(lambda: slots_held(stack) == 0, 10) + (time.monotonic() - started)
    finally:
        sock.close()
    wait_for(lambda: stack_idle(stack), 10)
    truth, charged = generated() - before_generated, completion() - before_charged
    print(f"{stack.profile}: freed after {freed_at:.1f}s, read {read} B, {truth} made, {charged} charged")
    assert ever_held and freed_at < LIFETIME_S + 2.0
    assert read < 1_000_000  # the reader got a small part of the answer
    # At least what the engine generated (the engine's pace, the larger of the learned one and the feed's,
    # rounds per sequence), never above the reservation. By the learned pace alone, on a busy host where the
    # inline profile learns its delivery pace, 27,792 were charged.
    assert 0.95 * truth <= charged <= 24 * 2000, (charged, truth)


FOLLOWED_CONFIG: dict[str, Any] = {
    "models": {"*": {"context_window": 4096, "default_max_tokens": 256}},
    "limits": {"global": {"max_concurrency": 1, "tokens_per_minute": 100_000_000}},
    "kv_budget": {"enabled": True},
}


@pytest.fixture(params=["inline", "lean"])
def followed_stack(request: pytest.FixtureRequest) -> Iterator[LocalStack]:
    """One slot, the KV feed and a forecasting KV budget: the engine's running count reaches the sidecar."""
    stack = build_stack(config=FOLLOWED_CONFIG, sim_args=SLOW_SIM, with_exporter=True, profile=request.param)
    try:
        stack.start()
        yield stack
    finally:
        stack.stop()


def test_a_slow_readers_slot_follows_the_engine_and_its_charge_the_engines_count(
    followed_stack: LocalStack,
) -> None:
    """24 x 2,000 tokens read at 10 KiB/s: the engine is done in about 4 s; its slot goes back once the feed
    confirms it, and a second request is admitted into the one slot while the slow client still reads. When
    the client goes, the charge is what the engine generated, as before."""
    stack = followed_stack
    wait_fed(stack, 15.0)
    teach_pace(stack)
    generated = functools.partial(metric, f"{stack.upstream_url}/metrics", "vllm:generation_tokens_total")
    completion = functools.partial(sidecar_metric, stack, "extproc_tokens_settled_total", kind="completion")
    before_generated, before_charged = generated(), completion()
    sock = slow_reader(stack)
    read, freed_at, engine_done_at, second = 0, None, None, None
    try:
        started = time.monotonic()
        while time.monotonic() - started < 30 and freed_at is None:  # 1 KiB every 0.1 s
            chunk = sock.recv(1024)
            assert chunk, "the answer ended early"
            read += len(chunk)
            if (
                engine_done_at is None
                and metric(f"{stack.upstream_url}/metrics", "vllm:num_requests_running") == 0
            ):
                engine_done_at = time.monotonic() - started
            if sidecar_metric(stack, "extproc_slots_released_early_total") == 1:
                freed_at = time.monotonic() - started
            time.sleep(0.1)
        assert freed_at is not None and engine_done_at is not None, (freed_at, engine_done_at)
        assert sidecar_metric(stack, "extproc_active_requests") == 1  # not settled: its tokens wait
        second = http("POST", f"{stack.envoy_url}/v1/chat/completions", CHAT)
        sock.recv(1024)  # the slow client still reads
    finally:
        sock.close()
    wait_for(lambda: stack_idle(stack), 10)
    truth, charged = generated() - before_generated, completion() - before_charged - 8
    print(
        f"{stack.profile}: engine done at {engine_done_at:.1f}s, slot back at {freed_at:.1f}s, "
        f"read {read} B, {truth} made, {charged} charged"
    )
    assert second.status == 200, second.body  # admitted into the slot given back
    assert freed_at - engine_done_at < 8.0  # the feed's samples, confirmed over settle_after
    assert read < 1_000_000  # the reader got a small part of the answer
    assert 0.95 * (truth - 8) <= charged <= 24 * 2000, (charged, truth)


def slow_reader(stack: LocalStack) -> socket.socket:
    """A raw client with a 4 KiB receive buffer that has sent a streamed chat of 24 x 2,000 tokens: its
    caller reads as slowly as it likes."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Write a long story."}],
        "n": 24,
        "max_tokens": 2000,
        "ignore_eos": True,
        "stream": True,
    }
    return slow_reader_post(stack.ports.envoy, "/v1/chat/completions", body)


def stack_idle(stack: LocalStack) -> bool:
    running = metric(f"{stack.upstream_url}/metrics", "vllm:num_requests_running")
    return running == 0 and sidecar_metric(stack, "extproc_active_requests") == 0


# ------------------------------------------------------------------------------------------------------------
# Refusals Envoy answers itself: counted where the operator looks, worded like the sidecar's, and readable.

EIGHT_MIB_CHAT = [{"role": "user", "content": "x" * (8 << 20)}]


async def _post_8_mib(url: str) -> str:
    """One 8 MiB chat request with the openai SDK's async transport (httpx, HTTP/1.1): the status and the
    message, or the transport error's name when the reply never arrived."""
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    try:
        await client.chat.completions.create(model=MODEL, messages=EIGHT_MIB_CHAT, max_tokens=5)  # type: ignore[arg-type]
        return "200"
    except openai.APIStatusError as err:
        body = err.body if isinstance(err.body, dict) else {}
        return f"{err.status_code} {body.get('message')}"
    except openai.APIConnectionError as err:
        return type(err.__cause__).__name__
    finally:
        await client.close()


@pytest.mark.parametrize(
    "lone_stack",
    [(profile, CONFIG, fixed_step_sim(MODEL, 5)) for profile in ("inline", "lean")],
    indirect=True,
    ids=["inline", "lean"],
)
def test_an_over_cap_body_gets_its_413_every_time_with_the_async_sdk(lone_stack: LocalStack) -> None:
    """Answered while the body still arrived, the 413 was reset 1 try in 6: now it is read first."""
    outcomes = [asyncio.run(_post_8_mib(lone_stack.envoy_url)) for _ in range(8)]
    # The sidecar's 413 names the body's size (8 MiB of content plus the JSON around it) and its cap.
    cap = AdmissionConfig().max_body_bytes
    opening = re.escape(refusals.BODY_TOO_LARGE)
    words = re.compile(rf"413 {opening}: (\d+) bytes, over its limit of {cap} bytes\.")
    sizes = [int(m[1]) if (m := words.fullmatch(outcome)) else None for outcome in outcomes]
    assert all(size is not None and size > 8 << 20 for size in sizes), outcomes


@pytest.mark.parametrize(
    "lone_stack", [("lean", CONFIG, fixed_step_sim(MODEL, 5))], indirect=True, ids=["lean"]
)
def test_envoys_own_refusals_are_counted_and_worded_like_the_sidecars(lone_stack: LocalStack) -> None:
    stack = lone_stack
    rejected = functools.partial(sidecar_metric, stack, "extproc_requests_total", decision="rejected")
    reply = http("GET", f"{stack.envoy_url}/v1/not-a-path")
    assert reply.status == 404
    sidecar_words = json.loads(refusals.unknown_path("GET", "/v1/not-a-path").body)["error"]["message"]
    assert reply.json()["error"]["message"] == sidecar_words
    wait_for(lambda: rejected(reason="unknown_path") == 1, 5)
    # Past the 12 MiB Envoy reads for the sidecar, Envoy answers itself, naming that bound. The body is sent
    # from a thread while the reply is read, so the reply is read whatever Envoy then does to the upload.
    size = 14 << 20
    sock = socket.create_connection(("127.0.0.1", stack.ports.envoy), timeout=10)
    head_bytes = (
        "POST /v1/chat/completions HTTP/1.1\r\nhost: gateway\r\ncontent-type: application/json\r\n"
        f"content-length: {size}\r\n\r\n"
    ).encode()
    sender = threading.Thread(target=_send_ignoring_reset, args=(sock, head_bytes + b"x" * size), daemon=True)
    sender.start()
    try:
        head, _, body = _read_reply(sock).partition(b"\r\n\r\n")
    finally:
        sock.close()
        sender.join(10)
    assert head.startswith(b"HTTP/1.1 413"), head
    assert json.loads(body)["error"]["message"] == refusals.envoy_too_large_message(DRAIN_BODY_BYTES)
    wait_for(lambda: rejected(reason="request_too_large") == 1, 5)
    assert sidecar_metric(stack, "extproc_end_reports_total", result="envoy_refusal") == 2


def _send_ignoring_reset(sock: socket.socket, data: bytes) -> None:
    with contextlib.suppress(OSError):
        sock.sendall(data)


def _read_reply(sock: socket.socket) -> bytes:
    """A whole HTTP/1.1 reply with a content-length (Envoy's local replies have one)."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head = data.split(b"\r\n\r\n", 1)[0].decode().lower()
    length = int(next(line.split(":")[1] for line in head.split("\r\n") if line.startswith("content-length")))
    while len(data.split(b"\r\n\r\n", 1)[1]) < length:
        data += sock.recv(65536)
    return data
