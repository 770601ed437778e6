"""The OpenAI surface over real HTTP: usage, streaming, errors, models, health."""

from __future__ import annotations

import asyncio

import aiohttp

from extproc.admission.vocabulary.tokens import count_chat_prompt, count_text
from extproc.sim.server import SimServer
from tests.support.sim import SimFactory, chat_body, json_events, metrics, read_sse


async def test_models_and_health(start_sim: SimFactory, http: aiohttp.ClientSession) -> None:
    sim = await start_sim(model="my-model", max_model_len=4096)
    async with http.get(sim.url + "/v1/models") as resp:
        body = await resp.json()
    assert body["object"] == "list"
    assert body["data"][0]["id"] == "my-model" and body["data"][0]["max_model_len"] == 4096
    async with http.get(sim.url + "/health") as resp:
        assert resp.status == 200


async def test_non_streaming_chat_usage_with_n(start_sim: SimFactory, http: aiohttp.ClientSession) -> None:
    sim = await start_sim()
    body = chat_body(max_tokens=7, n=3)
    async with http.post(sim.url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200
        out = await resp.json()
    prompt = count_chat_prompt(body["messages"])
    assert out["object"] == "chat.completion" and len(out["choices"]) == 3
    assert out["usage"] == {"prompt_tokens": prompt, "completion_tokens": 21, "total_tokens": prompt + 21}
    texts = [c["message"]["content"] for c in out["choices"]]
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    assert all(count_text(t) == 7 for t in texts) and len(set(texts)) == 3
    assert all(c["finish_reason"] == "length" for c in out["choices"])


async def test_streaming_chat_include_usage(start_sim: SimFactory, http: aiohttp.ClientSession) -> None:
    sim = await start_sim()
    body = chat_body(max_tokens=50, stream=True, stream_options={"include_usage": True}, sim_output_tokens=12)
    async with http.post(sim.url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        events = await read_sse(resp)
    assert events[-1] == "[DONE]"
    chunks = json_events(events)
    *content, usage_chunk = chunks
    assert usage_chunk["choices"] == []
    prompt = count_chat_prompt(body["messages"])
    assert usage_chunk["usage"] == {
        "prompt_tokens": prompt,
        "completion_tokens": 12,
        "total_tokens": prompt + 12,
    }
    assert all("usage" not in c for c in content)
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == usage_chunk["id"] for c in chunks)
    assert content[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    deltas = [c["choices"][0]["delta"]["content"] for c in content[1:]]
    assert len(deltas) == 12 and all(count_text(d) == 1 for d in deltas)
    assert count_text("".join(deltas)) == 12
    reasons = [c["choices"][0]["finish_reason"] for c in content]
    assert reasons[-1] == "stop" and set(reasons[:-1]) == {None}


async def test_streaming_completions_batch_prompt_header_override(
    start_sim: SimFactory, http: aiohttp.ClientSession
) -> None:
    sim = await start_sim()
    body = {"prompt": ["one two three", "four"], "max_tokens": 5, "n": 2, "stream": True}
    headers = {"x-sim-output-tokens": "9"}  # capped by max_tokens: finish_reason length
    async with http.post(sim.url + "/v1/completions", json=body, headers=headers) as resp:
        events = await read_sse(resp)
    assert events[-1] == "[DONE]"
    chunks = json_events(events)
    per_choice: dict[int, list[str]] = {}
    for c in chunks:
        assert c["object"] == "text_completion" and "usage" not in c
        (choice,) = c["choices"]
        per_choice.setdefault(choice["index"], []).append(choice["text"])
        if choice["finish_reason"] is not None:
            assert choice["finish_reason"] == "length"
    assert sorted(per_choice) == [0, 1, 2, 3]
    assert all(len(v) == 5 and count_text("".join(v)) == 5 for v in per_choice.values())


async def test_non_streaming_completions_token_prompt(
    start_sim: SimFactory, http: aiohttp.ClientSession
) -> None:
    sim = await start_sim()
    body = {"prompt": [1, 2, 3, 4], "max_tokens": 20, "sim_output_tokens": 4}
    async with http.post(sim.url + "/v1/completions", json=body) as resp:
        out = await resp.json()
    assert out["object"] == "text_completion"
    assert out["usage"] == {"prompt_tokens": 4, "completion_tokens": 4, "total_tokens": 8}
    assert out["choices"][0]["finish_reason"] == "stop" and count_text(out["choices"][0]["text"]) == 4


async def test_default_length_without_max_tokens_is_drawn_and_seeded(
    start_sim: SimFactory, http: aiohttp.ClientSession
) -> None:
    async def lengths(sim: SimServer) -> list[int]:
        out = []
        for _ in range(3):
            async with http.post(sim.url + "/v1/completions", json={"prompt": "hi"}) as resp:
                out.append((await resp.json())["usage"]["completion_tokens"])
        return out

    a = await lengths(await start_sim(seed=5, output_len_median=8.0, output_len_sigma=0.5))
    b = await lengths(await start_sim(seed=5, output_len_median=8.0, output_len_sigma=0.5))
    assert a == b and all(n >= 1 for n in a)


async def test_context_overflow_and_bad_requests(start_sim: SimFactory, http: aiohttp.ClientSession) -> None:
    sim = await start_sim(max_model_len=1024, num_gpu_blocks=128)
    async with http.post(sim.url + "/v1/chat/completions", json=chat_body(max_tokens=1020)) as resp:
        assert resp.status == 400
        err = (await resp.json())["error"]
    prompt = count_chat_prompt(chat_body()["messages"])
    assert err == {
        "message": "'max_tokens' or 'max_completion_tokens' is too large: 1020. This model's maximum "
        f"context length is 1024 tokens and your request has {prompt} input tokens (1020 > 1024 - {prompt}).",
        "type": "BadRequestError",
        "param": "max_tokens",
        "code": 400,
    }
    async with http.post(sim.url + "/v1/completions", json={"prompt": list(range(1024))}) as resp:
        assert resp.status == 400
        assert (await resp.json())["error"]["param"] == "input_tokens"
    async with http.post(sim.url + "/v1/completions", data=b"{not json") as resp:
        assert resp.status == 400
        assert (await resp.json())["error"]["type"] == "BadRequestError"
    async with http.post(sim.url + "/v1/chat/completions", json={"model": "llama-3-8b"}) as resp:
        assert resp.status == 400
        assert (await resp.json())["error"]["code"] == 400


async def test_build_app_works_with_aiohttp_test_utilities() -> None:
    from aiohttp.test_utils import TestClient, TestServer

    from extproc.sim import SimConfig, build_app

    app = build_app(SimConfig(time_scale=500.0, num_gpu_blocks=600))
    async with TestClient(TestServer(app, handler_cancellation=True)) as client:
        resp = await client.post("/v1/chat/completions", json=chat_body(max_tokens=3))
        assert resp.status == 200
        assert (await resp.json())["usage"]["completion_tokens"] == 3


async def test_a_missed_abort_decodes_the_answer_to_its_end(
    start_sim: SimFactory, http: aiohttp.ClientSession
) -> None:
    """`missed_abort_every=2`: the first client that leaves aborts its sequence, the second's decodes on to
    its 300 tokens (vLLM #54947), as the engine's counters show."""
    sim = await start_sim(missed_abort_every=2, time_scale=20.0)
    body = chat_body(max_tokens=300, stream=True, sim_output_tokens=300)
    for _ in range(2):
        async with http.post(sim.url + "/v1/chat/completions", json=body) as resp:
            assert resp.status == 200
            await resp.content.readline()  # the first event, then the client leaves
    for _ in range(200):
        page = await metrics(http, sim)
        if page.get("vllm:num_requests_running", 1.0) == 0:
            break
        await asyncio.sleep(0.05)
    assert page["vllm:request_success_total{finished_reason=abort}"] == 1
    assert page["vllm:request_success_total{finished_reason=length}"] == 1
    assert 300 < page["vllm:generation_tokens_total"] < 600  # the whole second answer, part of the first
