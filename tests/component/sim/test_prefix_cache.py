"""Prefix caching seen over HTTP: chats sharing a system prompt hit its cached blocks, as vLLM's
`vllm:prefix_cache_*` counters report; with `enable_prefix_caching=False` nothing is shared."""

from __future__ import annotations

import json
from typing import Any

import aiohttp

from extproc.admission.vocabulary.tokens import chat_prompt_ids
from extproc.sim.server import SimServer
from tests.support.sim import SimFactory, metrics

SYSTEM = {"role": "system", "content": "You answer questions about KV caches, briefly and exactly. " * 40}
QUERIES = "vllm:prefix_cache_queries_total"
HITS = "vllm:prefix_cache_hits_total"
CACHED = "vllm:prompt_tokens_cached_total"


def conversation(question: str, model: str = "llama-3-8b") -> dict[str, Any]:
    return {"model": model, "messages": [SYSTEM, {"role": "user", "content": question}], "max_tokens": 3}


async def ask(http: aiohttp.ClientSession, sim: SimServer, body: dict[str, Any]) -> int:
    """Send a chat and wait for its whole answer; returns its prompt tokens."""
    async with http.post(sim.url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200
        return int((await resp.json())["usage"]["prompt_tokens"])


def expected_hit(first: dict[str, Any], second: dict[str, Any], block_size: int = 16) -> int:
    """Tokens of `second` found cached after `first` ran: the whole blocks of their common leading ids,
    at most `num_tokens - 1` tokens."""
    a, b = chat_prompt_ids(first["messages"]), chat_prompt_ids(second["messages"])
    common = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    return min(common // block_size, (len(b) - 1) // block_size) * block_size


async def test_chats_sharing_a_system_prompt_hit_the_cache(
    start_sim: SimFactory, http: aiohttp.ClientSession
) -> None:
    sim = await start_sim(num_gpu_blocks=1000, aliases=("alias",), lora_adapters=("adapter",))
    first, second = conversation("What is a block?"), conversation("And what is eviction?")
    p1 = await ask(http, sim, first)
    m = await metrics(http, sim)
    assert (m[QUERIES], m[HITS], m[CACHED]) == (p1, 0, 0)

    p2 = await ask(http, sim, second)  # the first has finished: its blocks are free but still cached
    hit = expected_hit(first, second)
    assert hit >= 400
    m = await metrics(http, sim)
    assert m[QUERIES] == p1 + p2 and m[HITS] == hit and m[CACHED] == hit
    assert m["vllm:prompt_tokens_total"] == p1 + p2
    assert m["vllm:kv_cache_usage_perc"] == 0.0  # cached blocks of finished requests count as free

    # Another served name of the same model shares the cache; a LoRA adapter has its own.
    await ask(http, sim, conversation("What is a block?", model="alias"))
    whole_prompt = (p1 - 1) // 16 * 16  # all of the first's blocks but the one holding its last token
    assert (await metrics(http, sim))[HITS] == hit + whole_prompt
    p3 = await ask(http, sim, conversation("What is a block?", model="adapter"))
    m = await metrics(http, sim)
    assert p3 == p1 and m[HITS] == hit + whole_prompt and m[QUERIES] == p1 + p2 + p1 + p3


async def test_without_prefix_caching_nothing_is_shared(
    start_sim: SimFactory, http: aiohttp.ClientSession
) -> None:
    sim = await start_sim(num_gpu_blocks=1000, enable_prefix_caching=False)
    await ask(http, sim, conversation("What is a block?"))
    await ask(http, sim, conversation("And what is eviction?"))
    m = await metrics(http, sim)
    assert m[HITS] == 0 and m[QUERIES] == 0 and m[CACHED] == 0
    info = [k for k in m if k.startswith("vllm:cache_config_info")]
    assert len(info) == 1 and "enable_prefix_caching=False" in info[0]


async def test_prompt_tokens_details_report_the_hit_as_vllm_does(
    start_sim: SimFactory, http: aiohttp.ClientSession
) -> None:
    """With --enable-prompt-tokens-details, usage carries `prompt_tokens_details.cached_tokens` (0 on a
    miss, as vLLM writes it), in a JSON body and in a stream's usage event, for chat and completions."""
    sim = await start_sim(num_gpu_blocks=1000, enable_prompt_tokens_details=True)
    first, second = conversation("What is a block?"), conversation("And what is eviction?")
    async with http.post(sim.url + "/v1/chat/completions", json=first) as resp:
        assert (await resp.json())["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    streamed = second | {"stream": True, "stream_options": {"include_usage": True}}
    async with http.post(sim.url + "/v1/chat/completions", json=streamed) as resp:
        events = [line for line in (await resp.text()).splitlines() if line.startswith("data: {")]
    usage = json.loads(events[-1][6:])["usage"]
    assert usage["prompt_tokens_details"] == {"cached_tokens": expected_hit(first, second)}
    assert (await metrics(http, sim))[CACHED] == expected_hit(first, second)
    text = {"model": "llama-3-8b", "prompt": SYSTEM["content"], "max_tokens": 2}
    async with http.post(sim.url + "/v1/completions", json=text) as resp:
        prompt = (await resp.json())["usage"]["prompt_tokens"]
    async with http.post(sim.url + "/v1/completions", json=text) as resp:
        details = (await resp.json())["usage"]["prompt_tokens_details"]
    assert details == {"cached_tokens": (prompt - 1) // 16 * 16}


async def test_without_the_flag_usage_has_no_prompt_tokens_details(
    start_sim: SimFactory, http: aiohttp.ClientSession
) -> None:
    sim = await start_sim(num_gpu_blocks=1000)
    async with http.post(sim.url + "/v1/chat/completions", json=conversation("What is a block?")) as resp:
        assert "prompt_tokens_details" not in (await resp.json())["usage"]
