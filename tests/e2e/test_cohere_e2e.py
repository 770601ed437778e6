"""Cohere chat v2 (`/cohere/v2/chat`) through the real Envoy, the sidecar and the simulator, in both profiles:
settlement equals the usage the answer reports (written as floats, as vLLM writes it), token for token, and a
refusal comes in Cohere's error envelope without reaching the backend."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.ledger import Ledger, assert_exact
from tests.support.stack import Reply, Stack, fixed_step_sim, http, profile_stack

MODEL = "llama-3-8b"
PATH = "/cohere/v2/chat"
CONFIG: dict[str, Any] = {
    "admission": {"max_body_bytes": 65536, "bound_admission": False},
    # The simulator's chat framing for cl100k: with these costs the sidecar's prompt count is exact.
    "models": {
        "*": {
            "context_window": 8192,
            "default_max_tokens": 512,
            "template": {"per_message": 3, "per_request": 3},
        }
    },
    "limits": {"global": {"tokens_per_minute": 10_000_000}, "models": {MODEL: {"max_concurrency": 8}}},
}
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": [{"type": "text", "text": "Describe a river in one line."}]},
]
SHORT = {"x-sim-output-tokens": "6"}  # the answer stops before the bound


@pytest.fixture(scope="module")
def stack(make_stack: Any, profile: str) -> Iterator[Stack]:
    yield from profile_stack(make_stack, profile, CONFIG, fixed_step_sim(MODEL, 2))


def chat(stack: Stack, body: dict[str, Any], **headers: str) -> Reply:
    return http("POST", f"{stack.url}{PATH}", {"model": MODEL, "messages": MESSAGES, **body}, headers=headers)


def events(reply: Reply) -> list[Any]:
    """The stream's `data:` payloads, `[DONE]` as the string."""
    return [frame.decode() if frame == b"[DONE]" else json.loads(frame) for frame in reply.data_frames()]


def whole(counts: dict[str, Any]) -> tuple[int, int]:
    prompt, output = counts["input_tokens"], counts["output_tokens"]
    assert isinstance(prompt, float) and prompt.is_integer() and isinstance(output, float)  # vLLM's floats
    return int(prompt), int(output)


def test_a_buffered_chat_settles_to_its_usage_and_reserves_the_exact_prompt(stack: Stack) -> None:
    before = Ledger.read(stack)
    reply = chat(stack, {"max_tokens": 25})
    assert reply.status == 200, reply.body
    answer = reply.json()
    assert answer["finish_reason"] == "MAX_TOKENS" and answer["message"]["content"][0]["text"]
    prompt, output = whole(answer["usage"]["tokens"])
    delta = Ledger.read(stack) - before
    assert output == 25
    assert_exact(delta, prompt, output)
    assert delta.reserved == prompt + 25  # the sidecar counted the Cohere messages exactly


def test_a_streamed_chat_settles_to_its_message_end_usage_not_to_the_reservation(stack: Stack) -> None:
    """`documents` go to the template and are reserved for, but the simulator's template renders none: the
    settled prompt is the one `message-end` reports (read by the dialect inline, by the Lua reader lean)."""
    before = Ledger.read(stack)
    documents = ["The Nile flows north through eleven countries."]
    reply = chat(stack, {"max_tokens": 30, "stream": True, "documents": documents}, **SHORT)
    assert reply.status == 200, reply.body
    stream = events(reply)
    assert stream[-1] == "[DONE]" and stream[-2]["type"] == "message-end"
    deltas = [e for e in stream[:-1] if e["type"] == "content-delta"]
    prompt, output = whole(stream[-2]["delta"]["usage"]["billed_units"])
    assert len(deltas) == output == 6
    delta = Ledger.read(stack) - before
    assert_exact(delta, prompt, output)
    assert delta.reserved > prompt + 30  # the documents' tokens were reserved, then refunded


def test_a_refusal_is_in_cohere_s_envelope_and_never_reaches_the_backend(stack: Stack) -> None:
    before = stack.upstream_requests()
    body: dict[str, Any]
    for body in ({"messages": []}, {"max_tokens": 0}, {"messages": [{"role": "robot", "content": "hi"}]}):
        reply = chat(stack, body)
        assert reply.status == 400, body
        error = reply.json()
        assert set(error) == {"message"} and error["message"], error
    assert stack.upstream_requests() == before
