"""Client deadlines and the inference pool's headers through a real Envoy, in both profiles.

One slot, a class that queues for 8 s, and a simulator that streams 100 tokens a second: a request holding
the slot for 300 tokens frees it in about 3 s. A request whose deadline for its first token is sooner is
refused at once (429 `deadline_unmet`) instead of waiting; one whose deadline is later waits and gets in.
The lean profile reads the headers from the attributes its rendered ext_proc filter sends
(extproc/envoyconf/lean.py), the inline one from the request headers.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.stack import Reply, Stack, fixed_step_sim, http, profile_stack

pytestmark = pytest.mark.e2e

MODEL = "llama-3-8b"
OWN = "x-extproc-ttft-deadline-ms"
LLMD = "x-llm-d-slo-ttft-ms"
CONFIG: dict[str, Any] = {
    "admission": {
        "inference_pool": {
            "trust_fairness_id": True,
            "trust_objective": True,
            "objectives": {"summaries-offline": "batch"},
        }
    },
    "classes": [
        {"name": "standard", "queue": {"max_wait_seconds": 8}},
        {"name": "batch"},
    ],
    "default_class": "standard",
    "metrics": {"tenant_allowlist": ["team-a"]},
    "models": {"*": {"context_window": 4096, "default_max_tokens": 64}},
    "limits": {"global": {"max_concurrency": 1}},
}
UNTRUSTED = {**CONFIG, "admission": {}}
SIM_ARGS = fixed_step_sim(MODEL, 10)


@pytest.fixture(scope="module")
def stack(make_stack: Any, profile: str) -> Iterator[Stack]:
    yield from profile_stack(make_stack, profile, CONFIG, SIM_ARGS)


def chat(stack: Stack, headers: dict[str, str], max_tokens: int = 5) -> Reply:
    body = {
        "model": MODEL,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "messages": [{"role": "user", "content": "x"}],
    }
    return http("POST", f"{stack.url}/v1/chat/completions", body, headers)


def wait_for(condition: Any, what: str, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


class Holder:
    """A request holding the one slot for `max_tokens` tokens (10 ms each), in a thread."""

    def __init__(self, stack: Stack, max_tokens: int = 300) -> None:
        self.reply: Reply | None = None
        self.thread = threading.Thread(target=self._run, args=(stack, max_tokens), daemon=True)
        self.thread.start()
        wait_for(lambda: stack.sidecar("extproc_active_requests") == 1, "the holder was not admitted")

    def _run(self, stack: Stack, max_tokens: int) -> None:
        self.reply = chat(stack, {}, max_tokens)

    def join(self) -> None:
        self.thread.join(30)
        assert self.reply is not None and self.reply.status == 200


def timed(stack: Stack, headers: dict[str, str]) -> tuple[Reply, float]:
    started = time.monotonic()
    reply = chat(stack, headers)
    return reply, time.monotonic() - started


def test_a_deadline_the_full_queue_cannot_meet_is_refused_at_once(stack: Stack) -> None:
    upstream = stack.upstream_requests()
    holder = Holder(stack)
    try:
        for headers in ({OWN: "500"}, {LLMD: "500"}):
            reply, elapsed = timed(stack, headers)
            assert reply.status == 429, (headers, reply.body)
            assert reply.headers["x-extproc-reject-reason"] == "deadline_unmet"
            assert int(reply.headers["retry-after"]) >= 1
            assert "could not be met" in reply.json()["error"]["message"]
            # Refused on arrival, not after waiting: well inside the 500 ms it asked for.
            assert elapsed < 0.4, elapsed
    finally:
        holder.join()
    assert stack.upstream_requests() == upstream + 1  # only the holder reached the engine
    assert stack.sidecar("extproc_requests_total", decision="rejected", reason="deadline_unmet") >= 2
    wait_for(lambda: stack.sidecar("extproc_active_requests") == 0, "a lease leaked")


def test_the_llmd_deadline_within_reach_waits_for_the_slot(stack: Stack) -> None:
    holder = Holder(stack)
    try:
        reply, elapsed = timed(stack, {LLMD: "7000"})
    finally:
        holder.join()
    assert reply.status == 200, reply.body
    assert elapsed > 1.0, "it should have waited for the holder's slot"
    wait_for(lambda: stack.sidecar("extproc_active_requests") == 0, "a lease leaked")


def test_a_bad_deadline_of_the_gateways_own_header_is_a_400_naming_it(stack: Stack) -> None:
    upstream = stack.upstream_requests()
    reply = chat(stack, {OWN: "soon"})
    assert reply.status == 400
    error = reply.json()["error"]
    assert error["param"] == OWN and error["code"] == "invalid_value"
    ignored = chat(stack, {LLMD: "soon"})  # llm-d ignores a bad value of its header, so does the gateway
    assert ignored.status == 200
    assert stack.upstream_requests() == upstream + 1
    assert stack.sidecar("extproc_active_requests") == 0


def by_class(stack: Stack, klass: str) -> float:
    return stack.sidecar("extproc_requests_total", decision="admitted", **{"class": klass})


def test_trusted_pool_headers_name_the_class_and_tenant_and_untrusted_ones_are_ignored(stack: Stack) -> None:
    headers = {
        "x-gateway-inference-objective": "summaries-offline",
        "x-gateway-inference-fairness-id": "team-a",
    }
    batch, team = by_class(stack, "batch"), stack.sidecar("extproc_tenant_requests_total", tenant="team-a")
    assert chat(stack, headers).status == 200
    assert by_class(stack, "batch") == batch + 1
    assert stack.sidecar("extproc_tenant_requests_total", tenant="team-a") == team + 1
    reloads = stack.sidecar("extproc_config_reloads_total", result="applied")
    stack.stack.write_sidecar_config(UNTRUSTED)
    try:
        wait_for(
            lambda: stack.sidecar("extproc_config_reloads_total", result="applied") > reloads,
            "config not reloaded",
        )
        standard = by_class(stack, "standard")
        assert chat(stack, headers).status == 200
        assert by_class(stack, "batch") == batch + 1
        assert by_class(stack, "standard") == standard + 1
        assert stack.sidecar("extproc_tenant_requests_total", tenant="team-a") == team + 1
    finally:
        reloads = stack.sidecar("extproc_config_reloads_total", result="applied")
        stack.stack.write_sidecar_config(CONFIG)
        wait_for(
            lambda: stack.sidecar("extproc_config_reloads_total", result="applied") > reloads,
            "config not restored",
        )
