"""The shipped Envoy's connections to the engine, run by the real Envoy 1.40 (envoy/envoy.yaml's header:
Engine keep-alive, Retries; tests/unit/envoyconf/test_engine_connections.py holds every shipped config to
them).

The engine is a stand-in that keeps a connection open for the engine's keep-alive after each response, as
vLLM's uvicorn does, and records who closed it; Envoy is the shipped inline config without the sidecar
(devstack.envoy.remove_ext_proc), so only its routes and engine cluster act. Envoy must close an idle
connection before the engine would, retry a connect that failed, and never send again a request the engine
has read.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from devstack.envoy import remove_ext_proc, render_envoy_config
from devstack.processes import Ports, Process, envoy_command, free_port, wait_http
from tests.support.keepalive import ENGINE_KEEP_ALIVE_S
from tests.support.stack import Reply, http

pytestmark = pytest.mark.e2e

BODY = {"model": "m", "max_tokens": 4, "stream": True, "messages": [{"role": "user", "content": "hi"}]}


@dataclass
class Engine:
    """A keep-alive HTTP/1.1 server on a free port. `reset_after_read`: read each request whole, then reset
    the connection instead of answering (an engine that dies with the request in hand)."""

    keep_alive_s: float = ENGINE_KEEP_ALIVE_S
    reset_after_read: bool = False
    requests: list[bytes] = field(default_factory=list)
    closed_by: list[tuple[str, float]] = field(default_factory=list)
    """(who, seconds after the connection's last response) for each connection closed: `engine` when its
    keep-alive ran out, `peer` when Envoy closed it."""

    def __post_init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        buffered = b""
        last = time.monotonic()
        with conn:
            while True:
                conn.settimeout(self.keep_alive_s)
                try:
                    while b"\r\n\r\n" not in buffered:
                        data = conn.recv(65536)
                        if not data:
                            self.closed_by.append(("peer", time.monotonic() - last))
                            return
                        buffered += data
                    head, _, buffered = buffered.partition(b"\r\n\r\n")
                    length = next(
                        (
                            int(line.split(b":", 1)[1])
                            for line in head.split(b"\r\n")
                            if line.lower().startswith(b"content-length:")
                        ),
                        0,
                    )
                    while len(buffered) < length:
                        data = conn.recv(65536)
                        if not data:
                            self.closed_by.append(("peer", time.monotonic() - last))
                            return
                        buffered += data
                except TimeoutError:
                    self.closed_by.append(("engine", time.monotonic() - last))
                    return
                self.requests.append(head.split(b"\r\n")[0])
                buffered = buffered[length:]
                if self.reset_after_read:
                    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    return
                body = b'{"ok": true}'
                conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n")
                conn.sendall(b"content-length: %d\r\n\r\n%s" % (len(body), body))
                last = time.monotonic()

    def close(self) -> None:
        self.listener.close()


@contextmanager
def envoy_to(port: int, workdir: Path) -> Iterator[Ports]:
    """The shipped inline Envoy, without the sidecar, forwarding to 127.0.0.1:`port`."""
    ports = Ports.free()
    config = render_envoy_config(ports, upstream=("127.0.0.1", port))
    remove_ext_proc(config)
    path = workdir / "envoy.yaml"
    path.write_text(yaml.safe_dump(config))
    process = Process.start("envoy", envoy_command(path, ports.envoy_admin % 60000), workdir)
    try:
        wait_http(f"http://127.0.0.1:{ports.envoy_admin}/ready", 30, process)
        yield ports
    finally:
        process.stop()


def upstream_stat(ports: Ports, name: str) -> int:
    """A counter of the engine cluster (`cluster.llm_upstream.<name>`) from Envoy's admin."""
    key = f"cluster.llm_upstream.{name}"
    with urllib.request.urlopen(f"http://127.0.0.1:{ports.envoy_admin}/stats?filter=^{key}$", timeout=5) as r:
        for line in r.read().decode().splitlines():
            found, _, value = line.partition(": ")
            if found == key:
                return int(value)
    raise AssertionError(f"no stat {key}")


def generate(ports: Ports) -> Reply:
    return http("POST", f"http://127.0.0.1:{ports.envoy}/v1/chat/completions", BODY, timeout_s=20)


def test_envoy_closes_an_idle_engine_connection_before_the_engine_does(tmp_path: Path) -> None:
    engine = Engine()
    try:
        with envoy_to(engine.port, tmp_path) as ports:
            assert generate(ports).status == 200
            deadline = time.monotonic() + ENGINE_KEEP_ALIVE_S + 2
            while not engine.closed_by and time.monotonic() < deadline:
                time.sleep(0.05)
            ((who, idle_s),) = engine.closed_by
            assert who == "peer" and idle_s < ENGINE_KEEP_ALIVE_S, engine.closed_by
            assert upstream_stat(ports, "upstream_cx_idle_timeout") == 1
            # The next request opens a new connection.
            assert generate(ports).status == 200
            assert upstream_stat(ports, "upstream_cx_total") == 2
    finally:
        engine.close()


def test_a_failed_connect_is_retried_once(tmp_path: Path) -> None:
    with envoy_to(free_port(), tmp_path) as ports:  # nothing listens there
        assert generate(ports).status == 503
        assert upstream_stat(ports, "upstream_rq_retry") == 1
        assert upstream_stat(ports, "upstream_cx_connect_fail") == 2


def test_a_request_the_engine_read_is_never_sent_again(tmp_path: Path) -> None:
    """A reset after the request went out may come after the engine started generating: Envoy answers 503
    and does not send the prompt a second time."""
    engine = Engine(reset_after_read=True)
    try:
        with envoy_to(engine.port, tmp_path) as ports:
            assert generate(ports).status == 503
            assert upstream_stat(ports, "upstream_rq_retry") == 0
            assert engine.requests == [b"POST /v1/chat/completions HTTP/1.1"]
    finally:
        engine.close()
