"""A lease's end when the usual signals fail, and what Envoy answers itself, through a real Envoy.

* The sidecar down: Envoy's ext_proc filter fails closed; the client gets a retryable 503 with a retry hint
  in OpenAI JSON, not a bare 500 (envoy/envoy.yaml, local_reply_config).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from extproc.stack import LocalStack
from tests.e2e.conftest import fixed_step_sim, http, metric, start_stack

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
