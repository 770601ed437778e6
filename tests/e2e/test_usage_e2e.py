"""Exact settlement with the official `openai` SDK through the real Envoy, the sidecar and the simulator.

Every test compares the sidecar's own counters before and after one call, so a refund lost or counted twice
moves a number and fails the test.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.support.ledger import Ledger, assert_exact, prompt_byte_bound, wait_settled
from tests.support.stack import Stack, fixed_step_sim, profile_stack

MODEL = "llama-3-8b"
CONFIG: dict[str, Any] = {
    "admission": {"max_body_bytes": 65536, "tenant": {"header": "x-tenant"}},
    # The simulator frames chat messages the way OpenAI documents for cl100k (3 tokens per message, 3 to
    # prime the reply): with the same template costs the sidecar's prompt count is exact.
    "models": {
        "*": {
            "context_window": 8192,
            "default_max_tokens": 512,
            "template": {"per_message": 3, "per_request": 3},
        }
    },
    "limits": {
        "global": {"tokens_per_minute": 10_000_000},
        "models": {MODEL: {"max_concurrency": 16}},
        "tenants": {"single": {"max_concurrency": 1}},
    },
}
# 5 ms per decode step: answers of a few dozen tokens take a fraction of a second.
SIM_ARGS = fixed_step_sim(MODEL, 5)
MESSAGES: list[ChatCompletionMessageParam] = [
    {"role": "user", "content": "Summarise the plot of a long novel in a few words."}
]


@pytest.fixture(scope="module")
def stack(make_stack: Any, profile: str) -> Iterator[Stack]:
    yield from profile_stack(make_stack, profile, CONFIG, SIM_ARGS)


@pytest.fixture
def client(stack: Stack) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0) as c:
        yield c


def test_sync_non_streaming_usage_equals_settlement(stack: Stack, client: openai.OpenAI) -> None:
    before = Ledger.read(stack)
    result = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=40)
    assert result.usage is not None
    delta = Ledger.read(stack) - before
    assert_exact(delta, result.usage.prompt_tokens, result.usage.completion_tokens)
    # Admitted on the prompt's byte bound; `assert_exact` proves the correction to the exact count.
    assert delta.reserved == prompt_byte_bound(MESSAGES, 3, 3) + 40


def test_sync_streaming_with_client_usage(stack: Stack, client: openai.OpenAI) -> None:
    before = Ledger.read(stack)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=30,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    usage = chunks[-1].usage
    assert usage is not None and chunks[-1].choices == []
    delta = Ledger.read(stack) - before
    assert_exact(delta, usage.prompt_tokens, usage.completion_tokens)


def test_sync_streaming_without_usage_hides_the_injected_chunk(stack: Stack, client: openai.OpenAI) -> None:
    before = Ledger.read(stack)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=25,
        stream=True,
    )
    chunks = list(stream)
    assert all(c.usage is None for c in chunks)
    assert all(c.choices for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text
    delta = Ledger.read(stack) - before
    # The client saw no usage; the simulator's own counters are the truth to match.
    assert_exact(delta, int(delta.sim_prompt), 25)


def test_async_streaming_and_non_streaming(stack: Stack) -> None:
    async def run() -> tuple[Any, Any]:
        async with openai.AsyncOpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0) as c:
            plain = await c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12)
            stream = await c.chat.completions.create(
                model=MODEL,
                messages=MESSAGES,
                max_tokens=14,
                stream=True,
                stream_options={"include_usage": True},
            )
            chunks = [chunk async for chunk in stream]
            return plain, chunks[-1].usage

    before = Ledger.read(stack)
    plain, streamed_usage = asyncio.run(run())
    delta = Ledger.read(stack) - before
    prompt = plain.usage.prompt_tokens + streamed_usage.prompt_tokens
    completion = plain.usage.completion_tokens + streamed_usage.completion_tokens
    assert completion == 12 + 14
    assert_exact(delta, prompt, completion)


def test_completions_endpoint_settles_exactly(stack: Stack, client: openai.OpenAI) -> None:
    before = Ledger.read(stack)
    result = client.completions.create(model=MODEL, prompt=["Once upon a time", "In a galaxy"], max_tokens=9)
    assert result.usage is not None
    delta = Ledger.read(stack) - before
    assert_exact(delta, result.usage.prompt_tokens, result.usage.completion_tokens)


def test_client_closing_after_k_chunks_refunds_the_rest(stack: Stack) -> None:
    k = 6
    before = Ledger.read(stack)
    with openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0) as c:
        stream = c.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=3000,
            stream=True,
        )
        for i, _chunk in enumerate(stream):
            if i + 1 == k:
                break
        stream.close()
    assert wait_settled(stack, 1.0), "slot not released within one second"
    delta = Ledger.read(stack) - before
    # The first chunk carries only the role; each later one is one token. Chunks already in flight between
    # the simulator and the client when it closed are counted too, so allow a small excess.
    assert k - 1 <= delta.completion <= k - 1 + 40
    assert delta.refunded == delta.reserved - (delta.prompt + delta.completion)
    assert delta.reserved - delta.refunded < 100  # most of the 3,000-token reservation came back


def test_sdk_backs_off_on_429_and_succeeds_when_capacity_frees(stack: Stack) -> None:
    """Tenant `single` has one slot. While it is held, the SDK's call gets 429 and waits `retry-after`."""
    rejected_before = stack.sidecar("extproc_requests_total", decision="rejected", reason="concurrency")

    async def run() -> float:
        async with openai.AsyncOpenAI(
            base_url=f"{stack.url}/v1",
            api_key="unused",
            max_retries=5,
            default_headers={"x-tenant": "single"},
        ) as c:
            holder = await c.chat.completions.create(
                model=MODEL,
                messages=MESSAGES,
                max_tokens=150,
                stream=True,
            )
            first = await holder.__anext__()
            assert first.choices
            start = time.monotonic()
            waiter = asyncio.create_task(
                c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5)
            )
            async for _ in holder:  # the holder finishes after ~0.75 s, freeing the slot
                pass
            result = await waiter
            assert result.usage is not None and result.usage.completion_tokens == 5
            return time.monotonic() - start

    elapsed = asyncio.run(run())
    rejected = (
        stack.sidecar("extproc_requests_total", decision="rejected", reason="concurrency") - rejected_before
    )
    assert rejected >= 1
    assert elapsed >= 0.5
    assert wait_settled(stack)


def test_request_too_large_for_the_bucket_is_not_retried(stack: Stack) -> None:
    config = {**CONFIG, "limits": {**CONFIG["limits"], "tenants": {"tiny": {"tokens_per_minute": 100}}}}
    stack.stack.write_sidecar_config(config)
    deadline = time.monotonic() + 5
    while stack.sidecar("extproc_config_reloads_total", result="applied") < 1:
        assert time.monotonic() < deadline, "config not reloaded"
        time.sleep(0.05)
    before = stack.sidecar("extproc_requests_total", decision="rejected")
    with (
        openai.OpenAI(
            base_url=f"{stack.url}/v1", api_key="unused", max_retries=3, default_headers={"x-tenant": "tiny"}
        ) as c,
        pytest.raises(openai.RateLimitError) as err,
    ):
        c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=500)
    assert err.value.response.headers["x-should-retry"] == "false"
    assert stack.sidecar("extproc_requests_total", decision="rejected") - before == 1  # no retries
    stack.stack.write_sidecar_config(CONFIG)
