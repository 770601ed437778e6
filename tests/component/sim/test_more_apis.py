"""The simulator's other vLLM APIs over real HTTP: Responses, Anthropic Messages, token-in/token-out,
/invocations and pooling, each with usage equal to what the engine counted."""

from __future__ import annotations

import json
from typing import Any

import aiohttp

from extproc.admission.vocabulary.tokens import count_chat_prompt, count_text
from tests.support.sim import SimFactory, metrics

MODEL = "llama-3-8b"


async def named_events(resp: aiohttp.ClientResponse) -> list[tuple[str | None, Any]]:
    """(event name, data) of an SSE body; data is decoded JSON unless it is [DONE]."""
    text = (await resp.read()).decode()
    out = []
    for frame in text.split("\n\n"):
        if not frame.strip():
            continue
        name = None
        payload = None
        for line in frame.split("\n"):
            if line.startswith("event: "):
                name = line[len("event: ") :]
            elif line.startswith("data: "):
                raw = line[len("data: ") :]
                payload = raw if raw == "[DONE]" else json.loads(raw)
        out.append((name, payload))
    return out


async def post(
    http: aiohttp.ClientSession, url: str, body: dict[str, Any], **headers: str
) -> aiohttp.ClientResponse:
    return await http.post(url, json=body, headers=headers)


async def test_responses_buffered_and_streamed(start_sim: SimFactory, http: aiohttp.ClientSession) -> None:
    sim = await start_sim(model=MODEL)
    body = {"model": MODEL, "instructions": "Be brief.", "input": "Tell me a story.", "max_output_tokens": 9}
    prompt = count_chat_prompt(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me a story."}]
    )
    before = await metrics(http, sim)
    async with await post(http, sim.url + "/v1/responses", body) as resp:
        out = await resp.json()
    assert out["status"] == "incomplete" and out["incomplete_details"] == {"reason": "max_output_tokens"}
    assert out["usage"]["input_tokens"] == prompt and out["usage"]["output_tokens"] == 9
    assert count_text(out["output"][0]["content"][0]["text"]) == 9
    async with await post(
        http, sim.url + "/v1/responses", {**body, "stream": True}, **{"x-sim-output-tokens": "4"}
    ) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = await named_events(resp)
    kinds = [name for name, _ in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds.count("response.output_text.delta") == 4 and kinds[-1] == "response.completed"
    assert all(name == payload["type"] for name, payload in events)
    assert [payload["sequence_number"] for _, payload in events] == list(range(len(events)))
    final = events[-1][1]["response"]
    assert final["usage"]["input_tokens"] == prompt and final["usage"]["output_tokens"] == 4
    after = await metrics(http, sim)
    assert after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"] == 2 * prompt
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == 13


async def test_anthropic_messages_buffered_streamed_and_errors(
    start_sim: SimFactory, http: aiohttp.ClientSession
) -> None:
    sim = await start_sim(model=MODEL)
    body = {
        "model": MODEL,
        "max_tokens": 6,
        "system": "Terse.",
        "messages": [{"role": "user", "content": "Hi"}],
    }
    prompt = count_chat_prompt([{"role": "system", "content": "Terse."}, {"role": "user", "content": "Hi"}])
    async with await post(http, sim.url + "/v1/messages", body) as resp:
        out = await resp.json()
    assert out["type"] == "message" and out["stop_reason"] == "max_tokens"
    assert out["usage"] == {"input_tokens": prompt, "output_tokens": 6}
    async with await post(
        http, sim.url + "/v1/messages", {**body, "stream": True}, **{"x-sim-output-tokens": "3"}
    ) as resp:
        events = await named_events(resp)
    kinds = [name for name, _ in events]
    assert kinds == [
        "message_start",
        "content_block_start",
        *["content_block_delta"] * 3,
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert events[0][1]["message"]["usage"] == {"input_tokens": prompt, "output_tokens": 0}
    assert events[-2][1]["usage"] == {"input_tokens": prompt, "output_tokens": 3}
    assert events[-2][1]["delta"]["stop_reason"] == "end_turn"
    async with await post(
        http, sim.url + "/v1/messages", {k: v for k, v in body.items() if k != "max_tokens"}
    ) as resp:
        assert resp.status == 400
        error = await resp.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"


async def test_token_in_token_out(start_sim: SimFactory, http: aiohttp.ClientSession) -> None:
    sim = await start_sim(model=MODEL)
    body = {"token_ids": [1, 2, 3, 4, 5], "sampling_params": {"max_tokens": 4, "n": 2}}
    async with await post(http, sim.url + "/inference/v1/generate", body) as resp:
        out = await resp.json()
    assert out["usage"] == {"prompt_tokens": 5, "completion_tokens": 8, "total_tokens": 13}
    assert [len(c["token_ids"]) for c in out["choices"]] == [4, 4]
    stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
    async with await post(http, sim.url + "/inference/v1/generate", stream) as resp:
        events = await named_events(resp)
    assert events[-1] == (None, "[DONE]")
    usage = events[-2][1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 8
    assert sum(len(p["choices"][0]["token_ids"]) for _, p in events[:-2]) == 8


async def test_invocations_and_pooling_reach_the_engine_counters(
    start_sim: SimFactory, http: aiohttp.ClientSession
) -> None:
    sim = await start_sim(model=MODEL)
    before = await metrics(http, sim)
    chat: dict[str, Any] = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2}
    async with await post(http, sim.url + "/invocations", chat) as resp:
        assert (await resp.json())["object"] == "chat.completion"
    async with await post(http, sim.url + "/invocations", {"prompt": "Hello", "max_tokens": 2}) as resp:
        assert (await resp.json())["object"] == "text_completion"
    async with await post(http, sim.url + "/invocations", {"input": ["alpha", "beta gamma"]}) as resp:
        pooled = await resp.json()
    assert pooled["usage"]["prompt_tokens"] == count_text("alpha") + count_text("beta gamma")
    async with await post(http, sim.url + "/rerank", {"query": "q", "documents": ["a", "b", "c"]}) as resp:
        rerank = await resp.json()
    assert rerank["usage"]["prompt_tokens"] == 3 * (count_text("q") + 1)
    after = await metrics(http, sim)
    finished = sum(after[k] - before.get(k, 0) for k in after if k.startswith("vllm:request_success_total"))
    assert finished == 1 + 1 + 2 + 3
    expected_prompts = (
        count_chat_prompt(chat["messages"])
        + count_text("Hello")
        + pooled["usage"]["prompt_tokens"]
        + rerank["usage"]["prompt_tokens"]
    )
    assert after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"] == expected_prompts
