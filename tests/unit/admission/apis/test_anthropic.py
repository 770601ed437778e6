"""Anthropic Messages: validation, counting every block, edits, the SSE dialect and the error envelope."""

from __future__ import annotations

import json
from typing import Any

import pytest

from extproc.admission.apis import render_refusal
from extproc.admission.apis.anthropic import anthropic_refusal
from extproc.admission.intake.request import Api, BodyEdits
from extproc.admission.intake.reservation import Reservation
from extproc.admission.replies import refusals
from extproc.admission.replies.verdicts import Refusal
from extproc.admission.vocabulary.errors import AdmissionError
from extproc.admission.vocabulary.policy import MediaCosts, ModelPolicy, TemplateCosts
from extproc.core.limiter.limiter import RateLimitStatus, Reason, Rejection
from tests.unit.admission.apis_helpers import counts, edited, parse, plan, refused, sse, tk, track

M = Api("messages")


def body(**fields: Any) -> dict[str, Any]:
    return {
        "model": "m",
        "max_tokens": 64,
        "messages": [{"role": "user", "content": "Hello, Claude"}],
        **fields,
    }


# ------------------------------------------------------------------------------------------------------------
# counting


def test_system_and_plain_messages_count_like_chat() -> None:
    req = parse(M, body(system="You are terse."))
    assert counts(req) == [tk("system", "You are terse.", "user", "Hello, Claude")]
    framed = ModelPolicy(1_000_000, template=TemplateCosts(per_message=3, per_request=3))
    assert counts(req, framed) == [tk("system", "You are terse.", "user", "Hello, Claude") + 2 * 3 + 3]
    assert (req.requested_max_tokens, req.prompt_param, req.max_tokens_param) == (
        64,
        "messages",
        "max_tokens",
    )


def test_every_block_is_counted_as_the_server_renders_it() -> None:
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0K"}}
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "What is in this picture?"}, image]},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "Look closely.", "signature": "sig"},
                {"type": "redacted_thinking", "data": "EmwKAhgBEgy" * 50},
                {"type": "tool_use", "id": "toolu_1", "name": "zoom", "input": {"factor": 2, "où": "ici"}},
            ],
        },
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_1",
                    "content": [{"type": "text", "text": "zoomed"}, image],
                },
                {"type": "tool_reference", "tool_name": "zoom"},
            ],
        },
    ]
    system = [{"type": "text", "text": "Describe images."}]
    tools = [{"name": "zoom", "input_schema": {"type": "object"}}]
    policy = ModelPolicy(1_000_000, template=TemplateCosts(0, 0), media=MediaCosts(image_tokens=500))
    req = parse(M, body(system=system, messages=messages, tools=tools))
    expected = tk(
        "system", "Describe images.",
        "user", "What is in this picture?",
        "assistant", "Look closely.", "zoom", "toolu_1", json.dumps({"factor": 2, "où": "ici"}),
        "user", "tool", "toolu_1", "zoomed", "user", "zoom",
        json.dumps(tools, separators=(",", ":"), sort_keys=True),
    )  # fmt: skip
    assert counts(req, policy) == [expected + 2 * 500]
    # system, three messages, the tool message a tool_result becomes and the user message of its image
    assert req.prompts[0].messages == 6


def test_a_tool_result_in_an_assistant_message_is_inline_text() -> None:
    messages = [
        {"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "42"}]}
    ]
    req = parse(M, body(messages=messages))
    assert counts(req) == [tk("assistant", "Tool result: ", "42")]
    assert req.prompts[0].messages == 1


@pytest.mark.parametrize(
    ("fields", "code", "param"),
    [
        ({"max_tokens": None}, "missing_field", "max_tokens"),
        ({"max_tokens": 0}, "invalid_value", "max_tokens"),
        ({"max_tokens": 1.5}, "invalid_type", "max_tokens"),
        ({"model": ""}, "invalid_value", "model"),
        ({"messages": None}, "missing_field", "messages"),
        ({"messages": []}, "invalid_value", "messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "invalid_value", "messages[0].role"),
        ({"messages": [{"role": "user"}]}, "missing_field", "messages[0].content"),
        ({"messages": [{"role": "user", "content": 5}]}, "invalid_type", "messages[0].content"),
        (
            {"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
            "invalid_value",
            "messages[0].content[0].type",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "search_result", "source": "s"}]}]},
            "invalid_value",
            "messages[0].content[0].type",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
            "missing_field",
            "messages[0].content[0].text",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "tool_addition", "tool": {}}]}]},
            "invalid_value",
            "messages[0].content[0].type",
        ),
        ({"system": 7}, "invalid_type", "system"),
        ({"tools": {}}, "invalid_type", "tools"),
        ({"stream": 1}, "invalid_type", "stream"),
    ],
)
def test_validation_names_the_field(fields: dict[str, Any], code: str, param: str) -> None:
    err = refused(M, body(**fields))
    assert (err.code, err.param) == (code, param)


def test_the_reservation_is_the_prompt_plus_max_tokens() -> None:
    policy = ModelPolicy(context_window=1000, template=TemplateCosts(0, 0))
    assert plan(M, body(max_tokens=100), policy) == Reservation(tk("user", "Hello, Claude"), 100)
    with pytest.raises(AdmissionError) as info:
        plan(M, body(max_tokens=999), policy)
    assert (info.value.code, info.value.param) == ("context_length_exceeded", "max_tokens")


def test_edits_only_drop_a_stray_priority() -> None:
    # No `priority` field in the Messages API: a client's stray one goes, none is written.
    out = edited(M, body(priority=-9), BodyEdits(strip_priority=True, priority=4, include_usage=True))
    assert out is not None and "priority" not in out
    assert (
        edited(M, body(stream=True), BodyEdits(strip_priority=True, priority=4, include_usage=True)) is None
    )


# ------------------------------------------------------------------------------------------------------------
# dialect


def block_start(index: int, block: dict[str, Any]) -> tuple[str, Any]:
    return "content_block_start", {"type": "content_block_start", "index": index, "content_block": block}


def block_delta(index: int, kind: str, key: str, value: str) -> tuple[str, Any]:
    return "content_block_delta", {
        "type": "content_block_delta",
        "index": index,
        "delta": {"type": kind, key: value},
    }


def block_stop(index: int) -> tuple[str, Any]:
    return "content_block_stop", {"type": "content_block_stop", "index": index}


def stream(*, stop: bool = True, cache: bool = False) -> bytes:
    start_usage = {"input_tokens": 25, "output_tokens": 1}
    final_usage: dict[str, Any] = {"output_tokens": 12}
    if cache:
        final_usage.update(input_tokens=5, cache_read_input_tokens=16, cache_creation_input_tokens=4)
    message = {"id": "msg_1", "type": "message", "role": "assistant", "content": [], "usage": start_usage}
    events: list[tuple[str | None, Any]] = [
        ("message_start", {"type": "message_start", "message": message}),
        block_start(0, {"type": "thinking", "thinking": ""}),
        block_delta(0, "thinking_delta", "thinking", "Hmm"),
        block_delta(0, "signature_delta", "signature", "abc" * 30),
        block_stop(0),
        block_start(1, {"type": "text", "text": ""}),
        block_delta(1, "text_delta", "text", "Hello"),
        block_delta(1, "text_delta", "text", " there"),
        block_stop(1),
        block_start(2, {"type": "tool_use", "id": "t", "name": "search", "input": {}}),
        block_delta(2, "input_json_delta", "partial_json", '{"q": "x"}'),
        block_stop(2),
        ("ping", {"type": "ping"}),
    ]
    if stop:
        final = {"type": "message_delta", "delta": {"stop_reason": "tool_use"}, "usage": final_usage}
        events += [("message_delta", final), ("message_stop", {"type": "message_stop"})]
    return sse(*events)


COUNTED = tk("Hmm", "Hello", " there", "search", '{"q": "x"}')


@pytest.mark.parametrize("step", [0, 1, 13])
def test_message_delta_settles_the_completion(step: int) -> None:
    usage, tracker, out = track(M, stream(), step=step)
    assert (usage.prompt_tokens, usage.completion_tokens, usage.reported) == (25, 12, True)
    assert tracker.done_seen and not tracker.error_seen and out == stream()


def test_cache_reads_and_writes_are_part_of_the_prompt() -> None:
    usage, _, _ = track(M, stream(cache=True))
    assert (usage.prompt_tokens, usage.completion_tokens) == (5 + 16 + 4, 12)
    assert usage.cached_prompt_tokens == 16  # the cache reads; writes were computed
    plain, _, _ = track(M, stream())
    assert plain.cached_prompt_tokens is None


def test_a_stream_cut_before_message_delta_counts_what_passed() -> None:
    usage, tracker, _ = track(M, stream(stop=False))
    # message_start reported output_tokens 1 (already sent); the deltas after it are counted on top
    assert (usage.prompt_tokens, usage.completion_tokens) == (25, 1 + COUNTED)
    assert not tracker.done_seen


def test_error_events_and_error_bodies() -> None:
    error = {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}
    _, tracker, _ = track(M, stream(stop=False) + sse(("error", error)))
    assert tracker.error_seen and not tracker.done_seen
    _, tracker, _ = track(M, json.dumps(error).encode(), streaming=False)
    assert tracker.error_seen


def test_a_json_body_reports_usage_or_is_counted() -> None:
    answer = {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "content": [
            {"type": "thinking", "thinking": "Hmm", "signature": "s"},
            {"type": "text", "text": "Hello there"},
            {"type": "tool_use", "id": "t", "name": "search", "input": {"q": "x"}},
        ],
        "model": "m",
        "stop_reason": "tool_use",
        "usage": {"input_tokens": 3, "output_tokens": 20, "cache_read_input_tokens": 10},
    }
    usage, tracker, _ = track(M, json.dumps(answer).encode(), streaming=False)
    assert (usage.prompt_tokens, usage.completion_tokens) == (13, 20) and not tracker.error_seen
    usage, _, _ = track(M, json.dumps({**answer, "usage": None}).encode(), streaming=False)
    assert usage.completion_tokens == tk("Hmm", "Hello there", "search", json.dumps({"q": "x"}))


# ------------------------------------------------------------------------------------------------------------
# refusals


def test_refusals_on_messages_use_anthropics_envelope_and_keep_the_headers() -> None:
    status = RateLimitStatus(limit_requests=1, remaining_requests=0, limit_tokens=100, remaining_tokens=0)
    rejection = Rejection(Reason.TOKENS, "tenant:acme", retry_after_s=2.5, status=status)
    openai_shaped = refusals.rate_limited(rejection, "m", 500)
    rendered = render_refusal(Api("messages"), openai_shaped)
    payload = json.loads(rendered.body)
    assert payload["type"] == "error" and payload["error"]["type"] == "rate_limit_error"
    assert payload["error"]["message"] == json.loads(openai_shaped.body)["error"]["message"]
    assert (rendered.status, rendered.headers, rendered.reason) == (
        429,
        openai_shaped.headers,
        openai_shaped.reason,
    )
    assert dict(rendered.headers)["retry-after"]
    # every other API keeps OpenAI's envelope
    assert render_refusal(Api("chat"), openai_shaped) is openai_shaped
    assert render_refusal(None, openai_shaped) is openai_shaped


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (400, "invalid_request_error"),
        (404, "not_found_error"),
        (413, "request_too_large"),
        (503, "overloaded_error"),
        (500, "api_error"),
    ],
)
def test_anthropic_error_types_follow_the_status(status: int, kind: str) -> None:
    refusal = refusals.invalid(AdmissionError(status, "nope", code="x"))
    payload = json.loads(anthropic_refusal(refusal).body)
    assert payload == {"type": "error", "error": {"type": kind, "message": "nope"}}


def test_a_body_that_is_not_openai_json_still_renders() -> None:
    payload = json.loads(anthropic_refusal(Refusal(503, b"not json", "x")).body)
    assert payload["error"]["type"] == "overloaded_error" and payload["error"]["message"]
