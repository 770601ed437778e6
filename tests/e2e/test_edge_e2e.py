"""Edge hardening through the real Envoy: every reply Envoy makes itself is OpenAI error JSON, the request
phase is bounded, and client-sent control headers reach neither the sidecar nor the upstream.

The upstream is a small echo server in this process (not the simulator), so a test can see exactly which
headers and paths reached it and can make it answer with a body of its own. Envoy runs, in turn,
envoy/envoy.yaml, its lean rendering (envoy/envoy-lean.yaml) and the Istio EnvoyFilters (inline and lean)
applied to a bare gateway bootstrap, each as the local stack renders it (the sidecar's tenant header is
`x-org` here, not the shipped `x-tenant-id`), with the two request-phase timeouts shortened so the tests do
not wait a minute.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from http.client import HTTPResponse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc

from devstack.processes import Ports, Process, wait_http
from devstack.stack import LocalStack
from extproc.admission.replies import refusals
from extproc.envoyconf.lean import DRAIN_BODY_BYTES
from extproc.envoyconf.profiles import ENVOY_TEMPLATE
from tests.support.istio import (
    ISTIO_FILTER,
    ISTIO_LEAN_FILTER,
    apply_envoy_filter,
    bare_gateway,
)
from tests.support.stack import Reply, build_stack, http, metric

pytestmark = pytest.mark.e2e

TENANT_HEADER = "x-org"
REQUEST_HEADERS_TIMEOUT_S = 1.0
REQUEST_TIMEOUT_S = 3.0
CONFIG: dict[str, Any] = {
    "admission": {"max_body_bytes": 4096, "tenant": {"header": TENANT_HEADER, "default": "anonymous"}},
    "metrics": {"tenant_allowlist": ["evil", "anonymous"]},
    "models": {"*": {"context_window": 8192, "default_max_tokens": 16}},
    "limits": {"global": {"max_concurrency": 64}},
}
CHAT = {"model": "echo", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}
# Envoy's own 413 (envoy/envoy.yaml's local_reply_config), past the 12 MiB it reads for the sidecar; behind
# Istio, past the listener's buffer limit (2 MiB, envoy/istio/envoyfilter.yaml's LISTENER merge).
ENVOY_413 = refusals.envoy_too_large_message(DRAIN_BODY_BYTES)
ISTIO_ENVOY_413 = refusals.envoy_too_large_message(2 << 20)


@dataclass
class Seen:
    method: str
    path: str
    headers: dict[str, str]


@dataclass
class Echo:
    """Records what reached the upstream; answers chat completions like an OpenAI server, or with the status
    named in `x-echo-status` and a plain-text body of its own."""

    port: int
    seen: list[Seen] = field(default_factory=list)
    server: ThreadingHTTPServer | None = None
    connections: list[socket.socket] = field(default_factory=list)

    def start(self) -> Echo:
        echo = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                return

            def setup(self) -> None:
                super().setup()
                echo.connections.append(self.connection)

            def do_GET(self) -> None:
                echo.seen.append(Seen("GET", self.path, {k.lower(): v for k, v in self.headers.items()}))
                self.answer(200, b"upstream", "text/plain")

            def do_POST(self) -> None:
                echo.seen.append(Seen("POST", self.path, {k.lower(): v for k, v in self.headers.items()}))
                self.rfile.read(int(self.headers.get("content-length") or 0))
                status = self.headers.get("x-echo-status")
                if status:
                    self.answer(int(status), b"upstream says no", "text/plain")
                    return
                usage = {"prompt_tokens": 8, "completion_tokens": 1, "total_tokens": 9}
                message = {"role": "assistant", "content": "ok"}
                choice = {"index": 0, "message": message, "finish_reason": "stop"}
                body = {"id": "e", "object": "chat.completion", "choices": [choice], "usage": usage}
                self.answer(200, json.dumps(body).encode(), "application/json")

            def answer(self, status: int, body: bytes, content_type: str) -> None:
                self.send_response(status)
                self.send_header("content-type", content_type)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        """Stop listening and close Envoy's pooled connections too, so the upstream is really gone."""
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
        for connection in self.connections:
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)
        self.connections.clear()

    def paths(self) -> list[str]:
        return [s.path for s in self.seen]


def shorten_request_timeouts(config: dict[str, Any]) -> None:
    for listener in config["static_resources"]["listeners"]:
        hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
        hcm["request_headers_timeout"] = f"{REQUEST_HEADERS_TIMEOUT_S:g}s"
        hcm["request_timeout"] = f"{REQUEST_TIMEOUT_S:g}s"


def istio_gateway(workdir: Path, envoy_filter: Path = ISTIO_FILTER) -> Path:
    """An Istio EnvoyFilter applied to a bare gateway (routes: /v1/ only), as a stack template."""
    gateway = apply_envoy_filter(
        bare_gateway(), yaml.safe_load(envoy_filter.read_text())["spec"]["configPatches"]
    )
    gateway["admin"] = yaml.safe_load(ENVOY_TEMPLATE.read_text())["admin"]
    gateway["static_resources"]["listeners"][0]["name"] = "llm_ingress"
    path = workdir / "istio-gateway.yaml"
    path.write_text(yaml.safe_dump(gateway))
    return path


@dataclass
class Edge:
    stack: LocalStack
    echo: Echo
    flavour: str

    def sidecar(self, name: str, **labels: str) -> float:
        return metric(f"{self.stack.admin_url}/metrics", name, **labels)

    def wait_sidecar(self, name: str, want: float, timeout_s: float = 15.0) -> float:
        deadline = time.monotonic() + timeout_s
        value = self.sidecar(name)
        while value != want and time.monotonic() < deadline:
            time.sleep(0.05)
            value = self.sidecar(name)
        return value


ISTIO_FLAVOURS = {"istio": ISTIO_FILTER, "istio-lean": ISTIO_LEAN_FILTER}


@pytest.fixture(scope="module", params=["envoy.yaml", "lean", "istio", "istio-lean"])
def edge(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Edge]:
    ports = Ports.free()
    echo = Echo(ports.upstream).start()
    istio = ISTIO_FLAVOURS.get(request.param)
    template = ENVOY_TEMPLATE if istio is None else istio_gateway(tmp_path_factory.mktemp("istio"), istio)
    stack = build_stack(
        ports=ports,
        config=CONFIG,
        with_simulator=False,
        envoy_template=template,
        envoy_patch=shorten_request_timeouts,
        profile="lean" if request.param == "lean" else "inline",
    )
    try:
        stack.start()
        yield Edge(stack, echo, request.param)
    finally:
        stack.stop()
        echo.stop()


def assert_openai_error(reply: Reply, status: int) -> dict[str, Any]:
    """The reply is OpenAI's error envelope with all four keys, sent as application/json."""
    assert reply.status == status, reply
    assert reply.headers["content-type"] == "application/json", reply.headers
    error: dict[str, Any] = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    return error


@dataclass
class RawReply:
    status: int
    headers: dict[str, str]
    body: bytes
    elapsed_s: float

    def as_reply(self) -> Reply:
        return Reply(self.status, self.headers, self.body)


def read_reply(sock: socket.socket, started: float) -> RawReply:
    response = HTTPResponse(sock)
    response.begin()
    body = response.read()
    elapsed = time.monotonic() - started
    return RawReply(response.status, {k.lower(): v for k, v in response.getheaders()}, body, elapsed)


def raw_request(port: int, head: bytes, send_more: Callable[[socket.socket], None] | None = None) -> RawReply:
    """Send `head` (and whatever `send_more` sends, from another thread) on a fresh connection and read the
    one reply Envoy makes, however much of the request was sent."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        started = time.monotonic()
        sock.sendall(head)
        sender = None
        if send_more is not None:
            sender = threading.Thread(target=_ignore_disconnect, args=(send_more, sock), daemon=True)
            sender.start()
        reply = read_reply(sock, started)
        if sender is not None:
            sender.join(10)
        return reply


def _ignore_disconnect(send: Callable[[socket.socket], None], sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        send(sock)


def post_head(path: str, headers: dict[str, str]) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "host: edge", "content-type: application/json"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def test_client_tenant_and_envoy_headers_reach_neither_sidecar_nor_upstream(edge: Edge) -> None:
    anonymous = edge.sidecar("extproc_tenant_requests_total", tenant="anonymous")
    spoofed = {
        TENANT_HEADER: "evil",
        "x_org": "evil",  # CGI-style servers would read this as x-org: Envoy drops underscored names
        "x-envoy-retry-on": "5xx",
        "x-envoy-upstream-rq-timeout-ms": "1",
        "x-envoy-probe": "1",
        "x-probe": "kept",
    }
    reply = http("POST", f"{edge.stack.envoy_url}/v1/chat/completions", CHAT, spoofed)
    assert reply.status == 200, reply
    arrived = edge.echo.seen[-1].headers
    assert arrived["x-probe"] == "kept"  # the control: other client headers pass
    assert TENANT_HEADER not in arrived and "x_org" not in arrived
    assert not {name for name in spoofed if name.startswith("x-envoy-")} & set(arrived), arrived
    # The sidecar never saw the claimed tenant either: the request counted as the default tenant.
    assert edge.sidecar("extproc_tenant_requests_total", tenant="evil") == 0
    assert edge.sidecar("extproc_tenant_requests_total", tenant="anonymous") == anonymous + 1


def test_backend_metrics_are_not_served_but_health_is(edge: Edge) -> None:
    # A direct 404 route refuses them, in the words the sidecar uses for an unknown path.
    for path in ("/metrics", "/metrics/", "/%6detrics", "/v1/../metrics"):
        error = assert_openai_error(http("GET", f"{edge.stack.envoy_url}{path}"), 404)
        assert error["code"] == "unknown_url"
    assert not [p for p in edge.echo.paths() if "metrics" in p]
    if edge.flavour in ("envoy.yaml", "lean"):  # behind Istio, routes are the operator's (here: /v1/ only)
        health = http("GET", f"{edge.stack.envoy_url}/health")
        assert (health.status, health.body) == (200, b"upstream")


def test_upstream_answers_pass_unchanged(edge: Edge) -> None:
    reply = http("POST", f"{edge.stack.envoy_url}/v1/chat/completions", CHAT, {"x-echo-status": "500"})
    assert (reply.status, reply.body) == (500, b"upstream says no")
    assert reply.headers["content-type"] == "text/plain"


def test_an_engine_503_that_is_not_json_is_made_an_openai_error_inline(edge: Edge) -> None:
    """An engine refusing for want of room with a body SDKs cannot parse: the inline profile answers it
    itself, with its OpenAI error and a retry hint; the lean profile never sees the response, so it passes
    as the engine sent it. Either way the request was refunded in full (`engine_busy`)."""
    before = edge.sidecar("extproc_settlements_total", outcome="engine_busy")
    reply = http("POST", f"{edge.stack.envoy_url}/v1/chat/completions", CHAT, {"x-echo-status": "503"})
    if edge.flavour in ("envoy.yaml", "istio"):
        assert assert_openai_error(reply, 503)["code"] == "service_unavailable"
        assert int(reply.headers["retry-after"]) >= 1
    else:
        assert (reply.status, reply.body) == (503, b"upstream says no")
        assert reply.headers["content-type"] == "text/plain"
    deadline = time.monotonic() + 5
    while edge.sidecar("extproc_settlements_total", outcome="engine_busy") == before:
        assert time.monotonic() < deadline, "the engine's 503 was never settled engine_busy"
        time.sleep(0.05)


def test_sidecar_replies_pass_unchanged(edge: Edge) -> None:
    url = f"{edge.stack.envoy_url}/v1/chat/completions"
    bad = assert_openai_error(http("POST", url, raw=b'{"model": '), 400)
    assert bad["message"] != "The request could not be parsed."  # Envoy's own 400 text
    # Over the sidecar's 4 KiB cap, far under the 12 MiB Envoy buffers in both profiles: the sidecar's 413,
    # once the body is read, naming the body's size and the cap.
    big = {**CHAT, "messages": [{"role": "user", "content": "x" * 8192}]}
    too_large = assert_openai_error(http("POST", url, big), 413)
    size = len(json.dumps(big).encode())
    words = refusals.too_large_message(size, CONFIG["admission"]["max_body_bytes"])
    assert (too_large["message"], too_large["code"]) == (words, "request_too_large")


def test_chunked_body_over_envoy_buffer_gets_json_413(edge: Edge) -> None:
    chunk = b"x" * 65536
    frame = f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n"

    def send_13_mib(sock: socket.socket) -> None:
        for _ in range(208):  # 13 MiB, over the 12 MiB Envoy buffers for the sidecar
            sock.sendall(frame)
        sock.sendall(b"0\r\n\r\n")

    head = post_head("/v1/chat/completions", {"transfer-encoding": "chunked"})
    reply = raw_request(edge.stack.ports.envoy, head, send_13_mib).as_reply()
    error = assert_openai_error(reply, 413)
    words = ISTIO_ENVOY_413 if edge.flavour.startswith("istio") else ENVOY_413
    assert (error["message"], error["code"]) == (words, "request_too_large")


def test_oversized_headers_get_json_431(edge: Edge) -> None:
    reply = http("GET", f"{edge.stack.envoy_url}/v1/models", headers={"x-big": "a" * 40 * 1024})
    assert assert_openai_error(reply, 431)["code"] == "request_header_fields_too_large"


def test_headers_never_finished_get_json_408_at_the_headers_timeout(edge: Edge) -> None:
    reply = raw_request(edge.stack.ports.envoy, b"POST /v1/chat/completions HTTP/1.1\r\nhost: edge\r\n")
    assert assert_openai_error(reply.as_reply(), 408)["code"] == "request_timeout"
    assert REQUEST_HEADERS_TIMEOUT_S * 0.9 <= reply.elapsed_s < REQUEST_HEADERS_TIMEOUT_S + 5


def test_unfinished_bodies_are_cut_at_the_request_timeout_and_free_their_sidecar_streams(edge: Edge) -> None:
    """The finding: clients that send headers and never finish the body each hold a sidecar stream."""
    assert edge.wait_sidecar("extproc_streams_active", 0) == 0
    clients = 5
    head = post_head("/v1/chat/completions", {"content-length": "1000"}) + b'{"model": "e'
    replies: list[RawReply] = []
    threads = [
        threading.Thread(target=lambda: replies.append(raw_request(edge.stack.ports.envoy, head)))
        for _ in range(clients)
    ]
    for thread in threads:
        thread.start()
    # While the bodies are pending every client holds one ext_proc stream (headers were sent to the sidecar);
    # in the lean profile none: its stream opens with the whole body.
    holding = 0 if edge.flavour == "lean" else clients
    assert edge.wait_sidecar("extproc_streams_active", holding, timeout_s=REQUEST_TIMEOUT_S) == holding
    for thread in threads:
        thread.join(REQUEST_TIMEOUT_S + 10)
    assert len(replies) == clients
    for reply in replies:
        assert assert_openai_error(reply.as_reply(), 408)["code"] == "request_timeout"
        assert REQUEST_TIMEOUT_S * 0.9 <= reply.elapsed_s < REQUEST_TIMEOUT_S + 5
    assert edge.wait_sidecar("extproc_streams_active", 0) == 0


@contextlib.contextmanager
def sidecar_replaced(stack: LocalStack, servicer: object | None) -> Iterator[None]:
    """Stop the sidecar (and serve `servicer` on its port instead, if given); restart it afterwards."""
    stack.stop_process("sidecar")
    server = None
    if servicer is not None:
        server = grpc.server(ThreadPoolExecutor(max_workers=4))
        external_processor_pb2_grpc.add_ExternalProcessorServicer_to_server(servicer, server)
        server.add_insecure_port(f"127.0.0.1:{stack.ports.grpc}")
        server.start()
    try:
        yield
    finally:
        if server is not None:
            server.stop(0)
        assert stack.workdir is not None
        sidecar = Process.start("sidecar", stack.sidecar_argv(), stack.workdir)
        stack.processes["sidecar"] = sidecar
        wait_http(f"{stack.admin_url}/readyz", proc=sidecar)


# The generated gRPC base class has no stubs, so mypy sees Any (as for extproc's own servicer).
class StalledSidecar(external_processor_pb2_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    """Reads Envoy's messages and never answers, as a sidecar stuck in a long GC pause or a deadlock."""

    def Process(self, request_iterator: Iterable[object], context: grpc.ServicerContext) -> Iterator[object]:
        for _ in request_iterator:
            while context.is_active():
                time.sleep(0.05)
        yield from ()


def test_sidecar_down_gets_a_retryable_json_503(edge: Edge) -> None:
    with sidecar_replaced(edge.stack, None):
        reply = http("POST", f"{edge.stack.envoy_url}/v1/chat/completions", CHAT)
        error = assert_openai_error(reply, 503)
        assert (error["type"], error["code"]) == ("server_error", "service_unavailable")
        assert reply.headers["retry-after"] == "1"
    assert http("POST", f"{edge.stack.envoy_url}/v1/chat/completions", CHAT).status == 200


def test_stalled_sidecar_gets_json_504_at_the_message_timeout(edge: Edge) -> None:
    with sidecar_replaced(edge.stack, StalledSidecar()):
        started = time.monotonic()
        reply = http("POST", f"{edge.stack.envoy_url}/v1/chat/completions", CHAT)
        elapsed = time.monotonic() - started
        assert assert_openai_error(reply, 504)["code"] == "timeout"
        assert 4.9 <= elapsed < 10  # message_timeout: 5s (envoy/envoy.yaml's header says why)
    assert http("POST", f"{edge.stack.envoy_url}/v1/chat/completions", CHAT).status == 200


def test_backend_down_gets_json_503_and_settles(edge: Edge) -> None:
    """Envoy cannot connect to the engine: a retryable 503 that names the engine's outage, not the gateway's
    (`service_unavailable` is the sidecar's or its store's), in every attachment."""
    edge.echo.stop()
    try:
        reply = http("POST", f"{edge.stack.envoy_url}/v1/chat/completions", CHAT)
        assert assert_openai_error(reply, 503)["code"] == "engine_unavailable"
        assert reply.headers["x-extproc-reject-reason"] == "engine_down"
        assert int(reply.headers["retry-after"]) >= 1
    finally:
        edge.echo.start()
    # Envoy's reply went through the sidecar's response path (lean: its end report): the lease settled, as
    # the engine's outage (Envoy's response flags), not as a later filter's refusal.
    assert edge.wait_sidecar("extproc_active_requests", 0) == 0
    assert edge.sidecar("extproc_settlements_total", outcome="not_forwarded") == 0
    assert edge.sidecar("extproc_settlements_total", outcome="engine_unreachable") >= 1
