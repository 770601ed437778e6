"""Cohere chat v2 (`/cohere/v2/chat`) against the real engine, in both profiles: what the sidecar charges
equals vLLM's usage and its own counters, the prompt booked at admission is the engine's, and a refusal is in
Cohere's envelope.

vLLM 0.32.0 serves the route only with `VLLM_ENABLE_COHERE_API=1` and the `cohere` SDK installed
(entrypoints/cohere/api_router.py:273-309): the tier's engine is started with the first
(tests/engine/conftest.py) and scripts/engine-env.sh installs the second.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.engine.stacks import Ledger, assert_settled_as_engine
from tests.support.engine import ENGINE_TEST_TIMEOUT_S, MODEL
from tests.support.stack import Reply, Stack, http

pytestmark = [pytest.mark.engine, pytest.mark.timeout(ENGINE_TEST_TIMEOUT_S)]

PATH = "/cohere/v2/chat"
MESSAGES = [
    {"role": "system", "content": "You answer in one short sentence."},
    {"role": "user", "content": [{"type": "text", "text": "Summarise a long novel in a few words."}]},
]


def chat(stack: Stack, **fields: Any) -> Reply:
    body = {"model": MODEL, "messages": MESSAGES, **fields}
    return http("POST", f"{stack.url}{PATH}", body)


def counts(usage: dict[str, Any], key: str) -> tuple[int, int]:
    """vLLM writes Cohere's counts as floats (entrypoints/cohere/protocol.py:266-281)."""
    prompt, output = usage[key]["input_tokens"], usage[key]["output_tokens"]
    assert isinstance(prompt, float) and isinstance(output, float)
    return int(prompt), int(output)


def test_a_buffered_cohere_chat_settles_as_the_engine_counted(stack: Stack) -> None:
    before = Ledger.read(stack)
    reply = chat(stack, max_tokens=16)
    assert reply.status == 200, reply.body
    answer = reply.json()
    assert answer["finish_reason"] == "MAX_TOKENS"
    prompt, output = counts(answer["usage"], "tokens")
    assert counts(answer["usage"], "billed_units") == (prompt, output) and output == 16
    delta = Ledger.read(stack) - before
    assert_settled_as_engine(delta, prompt, 16)
    assert delta.reserved == prompt + 16  # the Cohere messages were counted as the engine renders them


def test_a_streamed_cohere_chat_settles_to_message_end(stack: Stack) -> None:
    before = Ledger.read(stack)
    reply = chat(stack, max_tokens=12, stream=True)
    assert reply.status == 200, reply.body
    frames = reply.data_frames()
    assert frames[-1] == b"[DONE]"
    events = [json.loads(frame) for frame in frames[:-1]]
    assert events[0]["type"] == "message-start" and events[-1]["type"] == "message-end"
    prompt, output = counts(events[-1]["delta"]["usage"], "billed_units")
    assert output == 12 and sum(e["type"] == "content-delta" for e in events) <= 12
    delta = Ledger.read(stack) - before
    assert_settled_as_engine(delta, prompt, 12)
    assert delta.reserved == prompt + 12


def test_a_refusal_is_in_cohere_s_envelope_and_the_engine_runs_nothing(stack: Stack) -> None:
    before = Ledger.read(stack)
    reply = chat(stack, max_tokens=0)
    assert reply.status == 400
    assert set(reply.json()) == {"message"}
    delta = Ledger.read(stack) - before
    assert (delta.reserved, delta.engine_prompt, delta.engine_generated) == (0, 0, 0)
