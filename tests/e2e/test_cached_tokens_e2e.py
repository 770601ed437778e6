"""Cached prompt tokens through the real Envoy, the sidecar and the simulator, in both profiles.

The simulator runs with vLLM's `--enable-prompt-tokens-details`, so its usage reports
`prompt_tokens_details.cached_tokens` from its prefix cache; the sidecar charges each cached token
`admission.cached_prompt_token_weight` (a quarter here) of a token. Every test diffs the sidecar's and the
simulator's counters around one call: the prompt is charged at the discount, the hit is counted whole in
`extproc_tokens_cached_prompt_total` and matches the simulator's own `vllm:prompt_tokens_cached_total`, and
the ledger stays exact (reserved - refunded + overrun = settled).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.support.ledger import Ledger
from tests.support.stack import Stack, fixed_step_sim, profile_stack

MODEL = "llama-3-8b"
WEIGHT = 0.25
CONFIG: dict[str, Any] = {
    "admission": {"max_body_bytes": 65536, "cached_prompt_token_weight": WEIGHT},
    # The simulator's chat framing (3 tokens per message, 3 per request): the sidecar's count is exact.
    "models": {"*": {"context_window": 8192, "template": {"per_message": 3, "per_request": 3}}},
    "limits": {"global": {"tokens_per_minute": 10_000_000}, "models": {MODEL: {"max_concurrency": 16}}},
}
SIM_ARGS = fixed_step_sim(MODEL, 2, "--enable-prompt-tokens-details")
SYSTEM: ChatCompletionMessageParam = {
    "role": "system",
    "content": "You answer questions about KV caches, briefly and exactly. " * 30,
}


@pytest.fixture(scope="module")
def stack(make_stack: Any, profile: str) -> Iterator[Stack]:
    yield from profile_stack(make_stack, profile, CONFIG, SIM_ARGS)


@pytest.fixture
def client(stack: Stack) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0) as c:
        yield c


@dataclass
class Counts:
    """The ledger plus both sides' cached-prompt counters and the sidecar's overrun."""

    ledger: Ledger
    overrun: float
    cached: float
    sim_cached: float

    @classmethod
    def read(cls, stack: Stack) -> Counts:
        ledger = Ledger.read(stack)  # waits for every lease to settle
        return cls(
            ledger=ledger,
            overrun=stack.sidecar("extproc_tokens_overrun_total"),
            cached=stack.sidecar("extproc_tokens_cached_prompt_total", model=MODEL),
            sim_cached=stack.upstream("vllm:prompt_tokens_cached_total"),
        )

    def __sub__(self, other: Counts) -> Counts:
        return Counts(
            self.ledger - other.ledger,
            self.overrun - other.overrun,
            self.cached - other.cached,
            self.sim_cached - other.sim_cached,
        )


def assert_discounted(delta: Counts, prompt: int, completion: int, cached: int) -> None:
    """`prompt` charged with its `cached` tokens at WEIGHT (the discount rounded down), the ledger exact."""
    charged = prompt - math.floor(cached * (1 - WEIGHT))
    ledger = delta.ledger
    assert (ledger.prompt, ledger.completion) == (charged, completion)
    assert ledger.reserved - ledger.refunded + delta.overrun == charged + completion
    assert (ledger.sim_prompt, ledger.sim_generated) == (prompt, completion)  # the engine did it all
    assert delta.cached == delta.sim_cached == cached


def ask(question: str) -> list[ChatCompletionMessageParam]:
    return [SYSTEM, {"role": "user", "content": question}]


def warm(stack: Stack, client: openai.OpenAI) -> None:
    """One answer that puts the system prompt's blocks in the simulator's prefix cache."""
    client.chat.completions.create(model=MODEL, messages=ask("What is a block?"), max_tokens=4)
    Ledger.read(stack)


def test_a_cache_hit_in_a_json_answer_is_charged_at_the_discount(stack: Stack, client: openai.OpenAI) -> None:
    warm(stack, client)
    before = Counts.read(stack)
    result = client.chat.completions.create(
        model=MODEL, messages=ask("And what is eviction, in one line?"), max_tokens=12
    )
    delta = Counts.read(stack) - before
    usage = result.usage
    assert usage is not None and usage.prompt_tokens_details is not None
    cached = usage.prompt_tokens_details.cached_tokens
    assert cached is not None and cached >= 256  # most of the system prompt's blocks
    assert_discounted(delta, usage.prompt_tokens, usage.completion_tokens, cached)


def test_a_stream_with_the_clients_usage_is_charged_at_the_discount(
    stack: Stack, client: openai.OpenAI
) -> None:
    warm(stack, client)
    before = Counts.read(stack)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=ask("Why evict the tail first?"),
        max_tokens=10,
        stream=True,
        stream_options={"include_usage": True},
    )
    usage = list(stream)[-1].usage
    delta = Counts.read(stack) - before
    assert usage is not None and usage.prompt_tokens_details is not None
    cached = usage.prompt_tokens_details.cached_tokens
    assert cached is not None and cached >= 256
    assert_discounted(delta, usage.prompt_tokens, usage.completion_tokens, cached)


def test_a_stream_whose_usage_the_sidecar_asked_for_is_charged_at_the_discount(
    stack: Stack, client: openai.OpenAI
) -> None:
    """The client asked for no usage: the sidecar injects include_usage, reads the hit from the usage event
    (inline) or the proxy's capture of it (lean), and strips the event; the simulator's counters say what
    the engine did."""
    warm(stack, client)
    before = Counts.read(stack)
    chunks = list(
        client.chat.completions.create(model=MODEL, messages=ask("What is a hit?"), max_tokens=8, stream=True)
    )
    delta = Counts.read(stack) - before
    assert all(chunk.usage is None for chunk in chunks)
    assert delta.sim_cached >= 256
    assert_discounted(
        delta, int(delta.ledger.sim_prompt), int(delta.ledger.sim_generated), int(delta.sim_cached)
    )


def test_a_miss_is_charged_in_full(stack: Stack, client: openai.OpenAI) -> None:
    before = Counts.read(stack)
    fresh: list[ChatCompletionMessageParam] = [{"role": "user", "content": "A question nobody asked before."}]
    result = client.chat.completions.create(model=MODEL, messages=fresh, max_tokens=5)
    delta = Counts.read(stack) - before
    usage = result.usage
    assert usage is not None and usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == 0
    assert_discounted(delta, usage.prompt_tokens, usage.completion_tokens, 0)
