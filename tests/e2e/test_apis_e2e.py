"""Every metered API through the real Envoy, the sidecar and the simulator: settlement equals the usage the
official SDKs report, token for token; refused paths never reach the backend.

Each test compares the sidecar's and the simulator's counters before and after its calls, so a token
charged twice, a refund lost or a request that slipped through moves a number and fails it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, cast

import anthropic
import openai
import pytest
from anthropic.types import DocumentBlockParam
from openai.types.responses import ResponseInputItemParam, ResponseInputParam

from tests.support.ledger import Ledger, assert_exact, wait_settled
from tests.support.stack import Reply, Stack, fixed_step_sim, http, profile_stack

MODEL = "llama-3-8b"
WINDOW = 8192
CONFIG: dict[str, Any] = {
    # Counted before admission (no bound admission, tests/e2e/test_bound_e2e.py covers it): each reservation
    # below is then the sidecar's own exact count, compared with the backend's.
    "admission": {"max_body_bytes": 65536, "tenant": {"header": "x-tenant"}, "bound_admission": False},
    # The simulator frames chat messages as OpenAI documents for cl100k (3 tokens per message, 3 to prime
    # the reply) and renders Responses and Messages requests as chat: with these costs the sidecar's prompt
    # count is exact, so each reservation is known to the token.
    "models": {
        "*": {
            "context_window": WINDOW,
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
SIM_ARGS = fixed_step_sim(MODEL, 2)
SHORT = {"x-sim-output-tokens": "6"}  # the answer stops (finish "stop") before the bound


@pytest.fixture(scope="module")
def stack(make_stack: Any, profile: str) -> Iterator[Stack]:
    yield from profile_stack(make_stack, profile, CONFIG, SIM_ARGS)


@pytest.fixture
def oai(stack: Stack) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0) as client:
        yield client


@pytest.fixture
def claude(stack: Stack) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=stack.url, api_key="unused", max_retries=0) as client:
        yield client


def post(stack: Stack, path: str, body: Any, **headers: str) -> Reply:
    return http("POST", f"{stack.url}{path}", body, headers=headers)


# ------------------------------------------------------------------------------------------------------------
# OpenAI Responses


def test_responses_buffered_settles_to_the_reported_usage(stack: Stack, oai: openai.OpenAI) -> None:
    before = Ledger.read(stack)
    result = oai.responses.create(
        model=MODEL, instructions="Answer briefly.", input="What is a KV cache?", max_output_tokens=40
    )
    assert result.usage is not None and result.status == "incomplete"  # the simulator fills the bound
    delta = Ledger.read(stack) - before
    assert_exact(delta, result.usage.input_tokens, result.usage.output_tokens)
    assert result.usage.output_tokens == 40
    assert delta.reserved == result.usage.input_tokens + 40  # the sidecar counted the prompt exactly


def test_responses_streamed_settles_to_the_completed_event(stack: Stack, oai: openai.OpenAI) -> None:
    before = Ledger.read(stack)
    # A replayed assistant turn without the id and status of an output message: the API takes it, but the
    # SDK's input types only describe output_text content inside a full ResponseOutputMessageParam.
    replayed = cast(
        ResponseInputItemParam,
        {"role": "assistant", "content": [{"type": "output_text", "text": "Nile, Amazon, Yangtze."}]},
    )
    items: ResponseInputParam = [
        {"role": "user", "content": [{"type": "input_text", "text": "Name three rivers."}]},
        replayed,
        {"role": "user", "content": "And three more?"},
    ]
    stream = oai.responses.create(
        model=MODEL,
        input=items,
        max_output_tokens=30,
        stream=True,
        extra_headers=SHORT,
    )
    events = list(stream)
    final = events[-1]
    assert final.type == "response.completed" and final.response.usage is not None
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    usage = final.response.usage
    assert len(deltas) == usage.output_tokens == 6
    delta = Ledger.read(stack) - before
    assert_exact(delta, usage.input_tokens, usage.output_tokens)


def test_responses_refusals_never_reach_the_backend(stack: Stack, oai: openai.OpenAI) -> None:
    before = stack.upstream_requests()
    with pytest.raises(openai.BadRequestError) as err:
        oai.responses.create(model=MODEL, input="hi", previous_response_id="resp_123")
    assert err.value.body is not None and "previous_response_id" in json.dumps(err.value.body)
    with pytest.raises(openai.BadRequestError) as err:
        oai.responses.create(model=MODEL, input="hi", tools=[{"type": "web_search_preview"}])
    assert "max_tool_calls" in str(err.value)
    assert stack.upstream_requests() == before


# ------------------------------------------------------------------------------------------------------------
# Anthropic Messages


def test_messages_buffered_settles_to_the_reported_usage(stack: Stack, claude: anthropic.Anthropic) -> None:
    before = Ledger.read(stack)
    result = claude.messages.create(
        model=MODEL,
        max_tokens=25,
        system="You are terse.",
        messages=[{"role": "user", "content": "Describe a river in one line."}],
    )
    delta = Ledger.read(stack) - before
    assert result.stop_reason == "max_tokens" and result.usage.output_tokens == 25
    assert_exact(delta, result.usage.input_tokens, result.usage.output_tokens)
    assert delta.reserved == result.usage.input_tokens + 25


def test_messages_streamed_settles_to_the_message_delta(stack: Stack, claude: anthropic.Anthropic) -> None:
    before = Ledger.read(stack)
    with claude.messages.stream(
        model=MODEL,
        max_tokens=30,
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "Look this up."}]},
            {
                "role": "assistant",
                "content": [
                    {"type": "tool_use", "id": "toolu_1", "name": "search", "input": {"q": "rivers"}}
                ],
            },
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "Nile"}],
            },
        ],
        tools=[{"name": "search", "input_schema": {"type": "object"}}],
        extra_headers=SHORT,
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text and final.stop_reason == "end_turn" and final.usage.output_tokens == 6
    delta = Ledger.read(stack) - before
    assert_exact(delta, final.usage.input_tokens, final.usage.output_tokens)


def test_messages_refusal_is_a_client_error_and_never_reaches_the_backend(
    stack: Stack, claude: anthropic.Anthropic
) -> None:
    before = stack.upstream_requests()
    document: DocumentBlockParam = {
        "type": "document",
        "source": {"type": "text", "media_type": "text/plain", "data": "x"},
    }
    with pytest.raises(anthropic.BadRequestError) as err:
        claude.messages.create(model=MODEL, max_tokens=10, messages=[{"role": "user", "content": [document]}])
    assert "document" in str(err.value)
    assert stack.upstream_requests() == before


def test_the_anthropic_sdk_backs_off_on_a_429_and_succeeds(stack: Stack) -> None:
    """Tenant `single` has one slot: while a stream holds it, the SDK's call gets 429, waits `retry-after`
    and succeeds once the stream ends."""
    rejected_before = stack.sidecar("extproc_requests_total", decision="rejected", reason="concurrency")
    message: Any = [{"role": "user", "content": "Hi"}]
    headers = {"x-tenant": "single"}
    with (
        anthropic.Anthropic(
            base_url=stack.url, api_key="unused", max_retries=0, default_headers=headers
        ) as one,
        anthropic.Anthropic(
            base_url=stack.url, api_key="unused", max_retries=5, default_headers=headers
        ) as other,
        ThreadPoolExecutor(max_workers=1) as pool,
    ):
        with one.messages.stream(model=MODEL, max_tokens=400, messages=message) as holder:
            next(iter(holder.text_stream))  # the slot is held from here on
            waiter = pool.submit(other.messages.create, model=MODEL, max_tokens=5, messages=message)
            wait_until(
                lambda: (
                    stack.sidecar("extproc_requests_total", decision="rejected", reason="concurrency")
                    > rejected_before
                ),
                5.0,
            )
            for _ in holder.text_stream:  # the holder finishes after about 0.8 s, freeing the slot
                pass
        result = waiter.result(timeout=30)
    assert result.usage.output_tokens == 5
    assert wait_settled(stack)


def wait_until(check: Callable[[], bool], limit_s: float) -> None:
    deadline = time.monotonic() + limit_s
    while not check():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


# ------------------------------------------------------------------------------------------------------------
# /invocations, token-in/token-out, pooling


def test_invocations_is_metered_as_the_api_its_body_is(stack: Stack) -> None:
    before = Ledger.read(stack)
    chat = post(
        stack,
        "/invocations",
        {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 9},
    )
    completion = post(stack, "/invocations", {"model": MODEL, "prompt": ["one", "two"], "max_tokens": 4})
    assert chat.status == completion.status == 200
    delta = Ledger.read(stack) - before
    usages = [chat.json()["usage"], completion.json()["usage"]]
    assert_exact(delta, sum(u["prompt_tokens"] for u in usages), sum(u["completion_tokens"] for u in usages))
    assert delta.completion == 9 + 2 * 4


def test_token_in_token_out_buffered_and_streamed_with_hidden_usage(stack: Stack) -> None:
    before = Ledger.read(stack)
    # n = 1: the simulator's prompt counter, like vLLM's, counts the prompt once per sequence
    body = {"token_ids": [791, 6460, 315, 264, 3446], "sampling_params": {"max_tokens": 7}}
    plain = post(stack, "/inference/v1/generate", body)
    assert plain.status == 200 and plain.json()["usage"]["completion_tokens"] == 7
    streamed = post(stack, "/inference/v1/generate", {**body, "stream": True})
    assert streamed.status == 200
    chunks = streamed.data_frames()
    assert chunks[-1] == b"[DONE]"
    decoded = [json.loads(c) for c in chunks[:-1]]
    # the sidecar asked for usage on the client's behalf and removed the usage-only chunk
    assert all(c["choices"] and "usage" not in c for c in decoded)
    assert sum(len(c["choices"][0]["token_ids"]) for c in decoded) == 7
    delta = Ledger.read(stack) - before
    assert_exact(delta, 2 * 5, 2 * 7)
    assert delta.reserved == 2 * (5 + 7)


def test_pooling_reaches_the_backend_only_when_admitted(stack: Stack) -> None:
    before = Ledger.read(stack)
    requests_before = stack.upstream_requests()
    rerank = post(
        stack, "/v1/rerank", {"model": MODEL, "query": "kv cache", "documents": ["keys", "values", "blocks"]}
    )
    assert rerank.status == 200
    prompt = rerank.json()["usage"]["prompt_tokens"]
    delta = Ledger.read(stack) - before
    assert_exact(delta, prompt, 0)
    assert delta.reserved >= prompt
    assert stack.upstream_requests() - requests_before == 3  # one finished request per (query, document)
    too_long = post(stack, "/v1/embeddings", {"model": MODEL, "input": "token " * (WINDOW + 500)})
    assert too_long.status == 400 and too_long.json()["error"]["code"] == "context_length_exceeded"
    assert stack.upstream_requests() - requests_before == 3


# ------------------------------------------------------------------------------------------------------------
# refused paths


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/metrics"),
        ("POST", "/collective_rpc"),
        ("POST", "/v1/messages/count_tokens"),
        ("GET", "/v1/responses/resp_1"),
        ("POST", "/v1/models/../../collective_rpc"),
        ("DELETE", "/v1/chat/completions"),
    ],
)
def test_refused_paths_get_a_json_404_and_never_reach_the_backend(
    stack: Stack, method: str, path: str
) -> None:
    before = stack.upstream_requests()
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}]} if method == "POST" else None
    reply = http(method, f"{stack.url}{path}", body)
    assert reply.status == 404
    assert reply.headers["content-type"].startswith("application/json")
    # Refused by the sidecar's path table, or (/metrics) by Envoy's own route in front of it.
    assert reply.json()["error"]["code"] in {"unknown_url", "not_found"}
    assert stack.upstream_requests() == before


def test_free_paths_pass_untouched(stack: Stack) -> None:
    models = http("GET", f"{stack.url}/v1/models")
    assert models.status == 200 and models.json()["data"][0]["id"] == MODEL
    assert http("GET", f"{stack.url}/health").status == 200


def test_nothing_is_held_and_every_token_is_accounted_for(stack: Stack) -> None:
    assert wait_settled(stack)
    assert stack.sidecar("extproc_active_requests") == 0
    reserved = stack.sidecar("extproc_tokens_reserved_total")
    refunded = stack.sidecar("extproc_tokens_refunded_total")
    overrun = stack.sidecar("extproc_tokens_overrun_total")
    settled = stack.sidecar("extproc_tokens_settled_total")
    assert reserved > 0
    assert reserved - refunded + overrun == settled
