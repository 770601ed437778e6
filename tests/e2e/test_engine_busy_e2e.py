"""The engine's own refusal through Envoy, in both profiles: a simulator bounded like vLLM's
`--max-num-queued-reqs` refuses part of a burst the sidecar admitted, with vLLM's 503.

Each refused request is settled `engine_busy` and refunded in full (the ledger moves by exactly what the
answered requests used), counted in `extproc_engine_refusals_total`, and the pool's adaptive scale drops (the
feed runs, so the scale exists). The client's 503 keeps the engine's OpenAI body; the inline profile adds the
sidecar's `retry-after` and reason, the lean profile passes it with the route's `x-ratelimit-*` headers only.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from extproc.admission.replies.refusals import REASON_HEADER
from tests.support.ledger import Ledger, wait_settled
from tests.support.stack import Reply, Stack, fixed_step_sim, http, start_stack
from tests.support.waiting import wait_for

MODEL = "llama-3-8b"
QUEUE = 3
BURST = 8
ANSWER_TOKENS = 100
CONFIG: dict[str, Any] = {
    "models": {"*": {"context_window": 1024, "default_max_tokens": 128}},
    "limits": {"models": {MODEL: {"max_concurrency": BURST}}},
    # Quick to recover from the stale start, slow enough that the drop is still seen after the burst.
    "adaptive": {"recovery_per_second": 0.2, "stale_after_seconds": 3.0},
}
# A 10 ms decode step: each admitted answer of 100 tokens holds its place in the engine's queue ~1 s.
SIM_ARGS = fixed_step_sim(MODEL, 10, "--max-num-queued-reqs", str(QUEUE))
SCALE = "extproc_adaptive_scale_ratio"


@pytest.fixture(scope="module")
def stack(profile: str) -> Iterator[Stack]:
    local = start_stack(CONFIG, SIM_ARGS, profile, with_exporter=True)
    try:
        yield Stack(local)
    finally:
        local.stop()


def chat(stack: Stack, index: int) -> Reply:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"request {index}"}],
        "max_tokens": ANSWER_TOKENS,
    }
    return http(
        "POST",
        f"{stack.url}/v1/chat/completions",
        body,
        {"x-sim-output-tokens": str(ANSWER_TOKENS)},
    )


def test_an_engine_503_is_refunded_retryable_and_drops_the_scale(stack: Stack, profile: str) -> None:
    wait_for(lambda: stack.sidecar(SCALE, pool=MODEL) == 1.0, 15.0, "the pool's full scale")
    before = Ledger.read(stack)
    with ThreadPoolExecutor(BURST) as pool:
        replies = list(pool.map(lambda i: chat(stack, i), range(BURST)))
    statuses = sorted(r.status for r in replies)
    answered = [r for r in replies if r.status == 200]
    refused = [r for r in replies if r.status == 503]
    assert len(answered) == QUEUE and len(refused) == BURST - QUEUE, statuses
    assert wait_settled(stack, 5.0)
    # Refunded in full: the ledger moved by what the answered requests used, nothing for the refused ones.
    delta = Ledger.read(stack) - before
    used = sum(r.json()["usage"]["total_tokens"] for r in answered)
    assert delta.prompt + delta.completion == used
    assert delta.refunded == delta.reserved - used
    assert stack.sidecar("extproc_settlements_total", outcome="engine_busy") == len(refused)
    assert stack.sidecar("extproc_settlements_total", outcome="upstream_error") == 0
    assert stack.sidecar("extproc_engine_refusals_total", model=MODEL, reason="queue_full") == len(refused)
    assert stack.upstream("vllm:admission_rejections_total", reason="max_num_queued_reqs") == len(refused)
    # Every refused client got the engine's retryable OpenAI error, with the sidecar's headers.
    for reply in refused:
        error = reply.json()["error"]
        assert error["type"] == "Service Unavailable" and error["code"] == 503
        assert "x-ratelimit-limit-requests" in reply.headers
        if profile == "inline":
            assert int(reply.headers["retry-after"]) >= 1
            assert int(reply.headers["retry-after-ms"]) >= 1000
            assert reply.headers[REASON_HEADER] == "engine_busy"
        else:  # the response passes without the sidecar
            assert "retry-after" not in reply.headers
    # The pool's scale dropped at the refusals, and recovers from there.
    assert stack.sidecar(SCALE, pool=MODEL) < 1.0
