"""Separate input and output tokens-per-minute limits through the real Envoy, the sidecar and the simulator,
in both profiles (docs/configuration.md, "Separate input and output limits").

Each tenant below has split limits of its own, so every test starts from full buckets: the input bucket holds
the prompt and the output bucket the reserved completion before admission; the settlement charges the output
bucket what was generated; a refusal names its bucket, with that bucket's refill wait, and nothing reaches the
engine.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.ledger import wait_settled
from tests.support.stack import Reply, Stack, fixed_step_sim, http, profile_stack

MODEL = "llama-3-8b"
INPUT_TPM, OUTPUT_TPM = 600, 300  # 10 and 5 tokens a second
SPLIT = {"input_tokens_per_minute": INPUT_TPM, "output_tokens_per_minute": OUTPUT_TPM}
CONFIG: dict[str, Any] = {
    "admission": {"max_body_bytes": 65536, "tenant": {"header": "x-tenant"}},
    "models": {"*": {"context_window": 8192, "template": {"per_message": 3, "per_request": 3}}},
    "limits": {
        "global": {"tokens_per_minute": 10_000_000},
        "models": {MODEL: {"max_concurrency": 16}},
        "tenants": {"writer": SPLIT, "reader": SPLIT},
    },
}
SIM_ARGS = fixed_step_sim(MODEL, 1)


@pytest.fixture(scope="module")
def stack(make_stack: Any, profile: str) -> Iterator[Stack]:
    yield from profile_stack(make_stack, profile, CONFIG, SIM_ARGS)


def ask(stack: Stack, tenant: str, content: str, max_tokens: int, generate: int = 1) -> Reply:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens}
    headers = {"x-tenant": tenant, "x-sim-output-tokens": str(generate)}
    return http("POST", f"{stack.url}/v1/chat/completions", body, headers)


def available(stack: Stack, key: str) -> float:
    return stack.sidecar("extproc_tokens_available", key=key)


def assert_ledger_exact(stack: Stack) -> None:
    assert wait_settled(stack)
    reserved, refunded = (
        stack.sidecar("extproc_tokens_reserved_total"),
        stack.sidecar("extproc_tokens_refunded_total"),
    )
    overrun, settled = (
        stack.sidecar("extproc_tokens_overrun_total"),
        stack.sidecar("extproc_tokens_settled_total"),
    )
    assert reserved - refunded + overrun == settled


def test_the_output_bucket_is_reserved_then_settled_and_refuses_by_name(stack: Stack) -> None:
    first = ask(stack, "writer", "Say hi.", max_tokens=250, generate=20)
    assert first.status == 200
    assert json.loads(first.body)["usage"]["completion_tokens"] == 20
    assert wait_settled(stack)
    # 250 reserved, 20 generated: the settlement gave 230 back (plus what refilled since, 5 a second).
    assert OUTPUT_TPM - 20 <= available(stack, "output:tenant:writer") <= OUTPUT_TPM - 10
    engine_before = stack.upstream_requests()
    refused = ask(stack, "writer", "Say hi.", max_tokens=OUTPUT_TPM - 1)
    assert refused.status == 429
    assert refused.headers["x-extproc-reject-reason"] == "output_tokens"
    assert 1 <= float(refused.headers["retry-after"]) <= 5  # 19 missing or fewer, at 5 a second
    assert refused.headers["x-ratelimit-limit-tokens"] == str(OUTPUT_TPM)  # the tightest bucket
    assert "output tokens per min" in json.loads(refused.body)["error"]["message"]
    too_large = ask(stack, "writer", "Say hi.", max_tokens=OUTPUT_TPM + 1)
    assert too_large.status == 429
    assert too_large.headers["x-extproc-reject-reason"] == "request_exceeds_token_limit"
    assert too_large.headers["x-should-retry"] == "false"
    assert stack.upstream_requests() == engine_before  # neither reached the engine
    assert_ledger_exact(stack)


def test_the_input_bucket_holds_the_prompt_and_refuses_by_name(stack: Stack) -> None:
    prompt = "tokens " * 350  # about 350 prompt tokens: one fits the input bucket, two do not
    first = ask(stack, "reader", prompt, max_tokens=5)
    assert first.status == 200
    used = json.loads(first.body)["usage"]["prompt_tokens"]
    assert 300 < used < INPUT_TPM
    assert wait_settled(stack)
    assert INPUT_TPM - used <= available(stack, "input:tenant:reader") <= INPUT_TPM - used + 20
    refused = ask(stack, "reader", prompt, max_tokens=5)
    assert refused.status == 429 and refused.headers["x-extproc-reject-reason"] == "input_tokens"
    assert float(refused.headers["retry-after"]) >= 1
    too_large = ask(stack, "reader", "tokens " * (INPUT_TPM + 10), max_tokens=5)
    assert too_large.status == 429
    assert too_large.headers["x-extproc-reject-reason"] == "request_exceeds_token_limit"
    assert "input tokens per min" in json.loads(too_large.body)["error"]["message"]
    assert_ledger_exact(stack)
