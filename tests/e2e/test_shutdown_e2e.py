"""Graceful shutdown of the sidecar process: SIGTERM drains in-flight streams instead of cutting them."""

from __future__ import annotations

import json
import signal
import socket
import time
from typing import Any

from tests.support.stack import fixed_step_sim, start_stack

MODEL = "llama-3-8b"
CONFIG: dict[str, Any] = {
    "server": {"shutdown_grace_seconds": 10},
    "limits": {"models": {MODEL: {"max_concurrency": 4}}},
}
# 20 ms per token: a 100-token answer streams for about two seconds.
SIM_ARGS = fixed_step_sim(MODEL, 20)


def test_sigterm_lets_the_open_stream_finish_then_exits_cleanly() -> None:
    stack = start_stack(config=CONFIG, sim_args=SIM_ARGS, envoy_patch=None)
    try:
        host, port = stack.envoy_url.removeprefix("http://").split(":")
        body = json.dumps(
            {
                "model": MODEL,
                "max_tokens": 100,
                "stream": True,
                "messages": [{"role": "user", "content": "go"}],
            }
        ).encode()
        sock = socket.create_connection((host, int(port)), timeout=30)
        sock.sendall(
            f"POST /v1/chat/completions HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n".encode()
            + body
        )
        first = sock.recv(65536)
        assert b"200 OK" in first
        sidecar = stack.processes["sidecar"]
        sidecar.popen.send_signal(signal.SIGTERM)
        started = time.monotonic()
        data = first
        while chunk := sock.recv(65536):
            data += chunk
        sock.close()
        assert b"data: [DONE]" in data and data.endswith(b"0\r\n\r\n"), data[-200:]  # complete, chunked
        assert data.count(b'"content"') >= 100  # every token arrived: the stream was not cut
        assert sidecar.popen.wait(15) == 0
        assert time.monotonic() - started < 12
        log = sidecar.log()
        assert "draining ext_proc streams" in log and "sidecar stopped" in log
    finally:
        stack.stop()
