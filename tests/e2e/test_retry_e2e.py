"""A saturated limit tells clients when to come back: the official SDK, with its default retries, gets in."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from typing import Any

import openai
import pytest

from tests.support.stack import Stack, fixed_step_sim

pytestmark = pytest.mark.e2e

MODEL = "llama-3-8b"
SLOTS = 8
ANSWER_TOKENS = 400
STEP_MS = 10  # 100 tokens per second per sequence: a 400-token answer takes 4 s
CONFIG: dict[str, Any] = {
    "admission": {"tenant": {"header": "x-tenant"}},
    "models": {"*": {"context_window": 8192}},
    "limits": {"models": {MODEL: {"max_concurrency": SLOTS}}},
}


def _hold_a_slot(stack: Stack, done: list[float]) -> None:
    body = {"model": MODEL, "max_tokens": ANSWER_TOKENS, "stream": True,
            "messages": [{"role": "user", "content": "tell me a story"}]}  # fmt: skip
    request = urllib.request.Request(
        stack.url + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json", "x-sim-output-tokens": str(ANSWER_TOKENS)},
    )
    with urllib.request.urlopen(request, timeout=60) as resp:
        resp.read()
    done.append(time.monotonic())


def test_the_default_openai_sdk_gets_through_a_saturated_limit(make_stack: Any) -> None:
    stack: Stack = make_stack(CONFIG, fixed_step_sim(MODEL, STEP_MS))
    done: list[float] = []
    holders = [threading.Thread(target=_hold_a_slot, args=(stack, done)) for _ in range(SLOTS)]
    for thread in holders:
        thread.start()
    deadline = time.monotonic() + 10
    while stack.sidecar("extproc_active_requests") < SLOTS:
        assert time.monotonic() < deadline, "the slots were not all taken"
        time.sleep(0.01)
    refused_before = stack.sidecar("extproc_requests_total", decision="rejected")
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused")  # default: 2 retries
    started = time.monotonic()
    with client.with_options(timeout=60) as sdk:
        result = sdk.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5
        )
    waited = time.monotonic() - started
    for thread in holders:
        thread.join()
    refusals = stack.sidecar("extproc_requests_total", decision="rejected") - refused_before
    first_free = min(done) - started
    print(
        f"SDK got in after {waited:.2f} s and {refusals:.0f} refusal(s); "
        f"first slot freed after {first_free:.2f} s"
    )
    assert result.usage is not None
    assert refusals <= 2  # its default two retries were enough
    assert waited < first_free + 2.0  # and it came back soon after a slot freed, not at a fixed backoff
