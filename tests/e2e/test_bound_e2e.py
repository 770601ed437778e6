"""Admission on the prompt's byte bound through the real Envoy, in both profiles (docs/admission.md,
"Admission on a bound"): admitted on the bound, corrected to the exact count while the answer still streams,
settled exactly; a bucket the bound would overflow admits on the exact count instead of refusing.

Each test diffs the sidecar's counters around one call, so a correction lost or applied twice moves a number.
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.ledger import prompt_byte_bound
from tests.support.stack import Stack, fixed_step_sim, http, profile_stack, scrape

MODEL = "llama-3-8b"
TIGHT_TPM = 1000
CONFIG: dict[str, Any] = {
    "admission": {"tenant": {"header": "x-tenant"}},
    # The simulator frames chat messages the way OpenAI documents for cl100k: with the same template costs
    # the sidecar's exact count equals the simulator's.
    "models": {"*": {"context_window": 8192, "template": {"per_message": 3, "per_request": 3}}},
    "limits": {
        "global": {"tokens_per_minute": 10_000_000},
        "tenants": {"tight": {"tokens_per_minute": TIGHT_TPM}},
    },
}
SIM_ARGS = fixed_step_sim(MODEL, 20)  # 20 ms a token: 40 tokens stream for most of a second
PROSE = "Admission control keeps a shared inference pool responsive under load. " * 20  # ~1.4 kB


@pytest.fixture(scope="module")
def stack(make_stack: Any, profile: str) -> Iterator[Stack]:
    yield from profile_stack(make_stack, profile, CONFIG, SIM_ARGS)


def chat(max_tokens: int, stream: bool = False) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": PROSE}],
    }
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return body


def counters(stack: Stack) -> dict[str, float]:
    """The ledger's counters from one scrape, so a settlement cannot land between two of them."""
    samples = scrape(f"{stack.stack.admin_url}/metrics")

    def total(name: str, **labels: str) -> float:
        return sum(
            value
            for (sample, sample_labels), value in samples.items()
            if sample == name and all(dict(sample_labels).get(k) == v for k, v in labels.items())
        )

    return {
        "reserved": total("extproc_tokens_reserved_total"),
        "refunded": total("extproc_tokens_refunded_total"),
        "overrun": total("extproc_tokens_overrun_total"),
        "prompt": total("extproc_tokens_settled_total", kind="prompt"),
        "completion": total("extproc_tokens_settled_total", kind="completion"),
        "active": total("extproc_active_requests"),
    }


def settled(stack: Stack, limit_s: float = 3.0) -> dict[str, float]:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        now = counters(stack)
        if now["active"] == 0:
            return now
        time.sleep(0.01)
    raise AssertionError("a lease was not settled in time")


def diff(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in after}


def post(stack: Stack, body: dict[str, Any]) -> urllib.request.Request:
    raw = json.dumps(body).encode()
    request = urllib.request.Request(f"{stack.url}/v1/chat/completions", data=raw, method="POST")
    request.add_header("content-type", "application/json")
    return request


def bound_of(body: dict[str, Any]) -> int:
    """What the sidecar reserves on the bound here: the prompt's bound (template 3 + 3) + max_tokens."""
    return prompt_byte_bound(body["messages"], 3, 3) + int(body["max_tokens"])


def test_admitted_on_the_bound_corrected_while_it_streams_and_settled_exactly(stack: Stack) -> None:
    before = settled(stack)
    body = chat(max_tokens=40, stream=True)
    request = post(stack, body)
    usage: dict[str, Any] | None = None
    refunded_while_streaming = None
    with urllib.request.urlopen(request, timeout=30) as resp:
        for n, line in enumerate(resp):
            if n == 4:  # a few tokens in, the answer still streams
                mid = counters(stack)
                assert mid["active"] - before["active"] == 1
                refunded_while_streaming = mid["refunded"] - before["refunded"]
            text = line.decode().strip()
            if text.startswith("data: {"):
                event = json.loads(text[6:])
                usage = event.get("usage") or usage
    assert usage is not None
    delta = diff(settled(stack), before)
    exact = int(usage["prompt_tokens"])
    assert delta["reserved"] == bound_of(body)  # admitted on the bound, not the count
    assert exact < bound_of(body) - 40
    # The difference came back while the answer streamed, exactly once.
    assert refunded_while_streaming == bound_of(body) - 40 - exact
    assert delta["prompt"] == exact and delta["completion"] == usage["completion_tokens"]
    assert delta["reserved"] - delta["refunded"] + delta["overrun"] == delta["prompt"] + delta["completion"]


def test_a_client_that_leaves_mid_stream_is_settled_on_the_exact_count(stack: Stack) -> None:
    before = settled(stack)
    body = chat(max_tokens=200, stream=True)
    request = post(stack, body)
    with urllib.request.urlopen(request, timeout=30) as resp:
        for n, _line in enumerate(resp):
            if n == 6:
                break
    delta = diff(settled(stack), before)
    assert delta["reserved"] == bound_of(body)
    assert delta["prompt"] < bound_of(body) - 200  # the exact prompt, not the bound
    assert delta["reserved"] - delta["refunded"] + delta["overrun"] == delta["prompt"] + delta["completion"]


def test_a_bucket_the_bound_would_overflow_admits_on_the_exact_count(stack: Stack) -> None:
    """The tenant's bucket holds less than the bound but more than the exact need: admitted, not refused."""
    body = chat(max_tokens=1)
    assert bound_of(body) > TIGHT_TPM  # the bound alone would be refused as too large for the bucket
    before = settled(stack)
    reply = http("POST", f"{stack.url}/v1/chat/completions", body, {"x-tenant": "tight"})
    assert reply.status == 200, reply.body
    delta = diff(settled(stack), before)
    exact = reply.json()["usage"]["prompt_tokens"]
    assert delta["reserved"] == exact + 1  # counted first: reserved on the exact count
    assert delta["prompt"] == exact
