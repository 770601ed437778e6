"""Cohere chat v2 on vLLM (extproc/admission/apis/cohere_chat.py): counting every message field, validation,
the output bound and edits, the dialect of its bodies and events (usage as floats) and its error envelope."""

from __future__ import annotations

import json
from typing import Any

import pytest

from extproc.admission.apis import render_refusal, spec_of
from extproc.admission.apis.cohere_chat import count_number
from extproc.admission.intake.paths import DEFAULT_TABLE
from extproc.admission.intake.request import Api, BodyEdits, StepWork
from extproc.admission.intake.reservation import Reservation
from extproc.admission.replies import refusals
from extproc.admission.vocabulary.policy import MediaCosts, ModelPolicy, TemplateCosts
from extproc.core.limiter.limiter import RateLimitStatus, Reason, Rejection
from tests.unit.admission.apis_helpers import compact, counts, edited, parse, plan, refused, sse, tk, track

C = Api("cohere_chat")


def body(**fields: Any) -> dict[str, Any]:
    return {"model": "command-a", "messages": [{"role": "user", "content": "Hello"}], **fields}


# ------------------------------------------------------------------------------------------------------------
# routing and counting


def test_the_path_is_metered_as_cohere_chat_on_vllm() -> None:
    rule = DEFAULT_TABLE.route("POST", "/cohere/v2/chat")
    assert rule is not None and rule.api == C and rule.engines == "vLLM"
    assert DEFAULT_TABLE.route("POST", "/cohere/v2/chat/render") is None  # still refused
    assert spec_of(C).usage_option is False  # vLLM always streams usage


def test_plain_messages_count_like_chat_with_the_template_costs() -> None:
    req = parse(
        C, body(messages=[{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}])
    )
    assert counts(req) == [tk("system", "Be terse.", "user", "Hi")]
    framed = ModelPolicy(1_000_000, template=TemplateCosts(per_message=3, per_request=3))
    assert counts(req, framed) == [tk("system", "Be terse.", "user", "Hi") + 2 * 3 + 3]
    assert (req.prompt_param, req.max_tokens_param, req.sequences, req.stream) == (
        "messages",
        "max_tokens",
        1,
        False,
    )


def test_every_block_and_templated_field_is_counted() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "zoom", "arguments": '{"f":2}'}}
    document = {"type": "document", "document": {"data": {"text": "river"}, "id": "d"}}
    messages = [
        {"role": "developer", "content": [{"type": "text", "text": "Use tools."}]},
        {
            "role": "user",
            "content": [{"type": "text", "text": "Look"}, {"type": "image_url", "image_url": {"url": "u"}}],
        },
        {"role": "assistant", "tool_plan": "I will zoom.", "tool_calls": [call]},  # no content: allowed
        {"role": "tool", "tool_call_id": "c1", "content": [document]},
        {
            "role": "assistant",
            "content": [{"type": "thinking", "thinking": "Hm."}, {"type": "text", "text": "A"}],
        },
    ]
    tools = [{"type": "function", "function": {"name": "zoom", "parameters": {"type": "object"}}}]
    documents = ["The Nile.", {"id": "d2", "data": {"text": "The Amazon."}}]
    thinking = {"type": "enabled", "token_budget": 100}
    kwargs = {"date_string": "today"}
    req = parse(
        C,
        body(
            messages=messages,
            tools=tools,
            documents=documents,
            safety_mode="STRICT",
            thinking=thinking,
            chat_template_kwargs=kwargs,
        ),
    )
    policy = ModelPolicy(1_000_000, template=TemplateCosts(0, 0), media=MediaCosts(image_tokens=50))
    expected = tk(
        "developer", "Use tools.",
        "user", "Look",
        "assistant", "I will zoom.", compact([call]),
        "tool", "c1", compact(document["document"]),
        "assistant", "Hm.", "A",
        compact(tools), compact(documents), "today", "STRICT", compact(thinking),
    )  # fmt: skip
    assert counts(req, policy) == [expected + 50]
    assert req.prompts[0].messages == 5


@pytest.mark.parametrize(
    ("fields", "code", "param"),
    [
        ({"model": None}, "missing_field", "model"),
        ({"messages": None}, "missing_field", "messages"),
        ({"messages": []}, "invalid_value", "messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "invalid_value", "messages[0].role"),
        ({"messages": [{"role": "user"}]}, "missing_field", "messages[0].content"),
        ({"messages": [{"role": "tool", "content": "42"}]}, "missing_field", "messages[0].tool_call_id"),
        ({"messages": [{"role": "user", "content": 5}]}, "invalid_type", "messages[0].content"),
        ({"max_tokens": 0}, "invalid_value", "max_tokens"),
        ({"max_tokens": 2.0}, "invalid_type", "max_tokens"),
        ({"stream": "yes"}, "invalid_type", "stream"),
    ],
)
def test_validation_names_the_field(fields: dict[str, Any], code: str, param: str) -> None:
    error = refused(C, body(**fields))
    assert (error.code, error.param) == (code, param)


# ------------------------------------------------------------------------------------------------------------
# output bound, per-step work, edits


def test_max_tokens_bounds_the_output_and_nothing_declares_a_least_output() -> None:
    policy = ModelPolicy(context_window=4096, template=TemplateCosts(0, 0))
    prompt = tk("user", "Hello")
    assert plan(C, body(max_tokens=40), policy) == Reservation(prompt, 40)
    # vLLM's Cohere schema has no min_tokens or ignore_eos: a stray one is ignored, as vLLM ignores it
    req = parse(C, body(max_tokens=40, min_tokens=30, ignore_eos=True))
    assert (req.min_tokens, req.ignore_eos, req.truncate_prompt_tokens) == (0, False, None)


def test_stop_sequences_and_logprobs_are_per_step_work() -> None:
    req = parse(C, body(stop_sequences=["a", "b"], logprobs=True))
    assert req.work == StepWork(stop=2, logprobs=0, stop_param="stop_sequences")
    assert parse(C, body()).work == StepWork(stop_param="stop_sequences")


def test_edits_write_max_tokens_and_the_priority_but_never_stream_options() -> None:
    out = edited(C, body(stream=True), BodyEdits(include_usage=True, max_tokens=128, priority=5))
    assert out is not None
    assert (out["max_tokens"], out["priority"], "stream_options" in out) == (128, 5, False)
    assert edited(C, body(max_tokens=9), BodyEdits(max_tokens=128)) is None  # the client's bound stays
    stripped = edited(C, body(priority=-3), BodyEdits(strip_priority=True))
    assert stripped is not None and "priority" not in stripped


# ------------------------------------------------------------------------------------------------------------
# what the answers carry

USAGE = {
    "billed_units": {"input_tokens": 11.0, "output_tokens": 4.0},
    "tokens": {"input_tokens": 12.0, "output_tokens": 5.0},
    "cached_tokens": 0.0,
}


def test_a_body_reports_its_usage_as_floats_and_tokens_wins_over_billed_units() -> None:
    answer = {
        "id": "c",
        "finish_reason": "COMPLETE",
        "message": {"role": "assistant", "content": [{"type": "text", "text": "Hello"}]},
        "usage": USAGE,
    }
    usage, tracker, _ = track(C, json.dumps(answer).encode(), streaming=False)
    assert (usage.prompt_tokens, usage.completion_tokens, usage.reported) == (12, 5, True)
    assert not tracker.error_seen
    billed_only = {**answer, "usage": {"billed_units": USAGE["billed_units"]}}
    usage, _, _ = track(C, json.dumps(billed_only).encode(), streaming=False)
    assert (usage.prompt_tokens, usage.completion_tokens) == (11, 4)


def test_a_body_without_usage_counts_its_text_tool_plan_and_tool_calls() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "zoom", "arguments": '{"f":2}'}}
    message = {
        "role": "assistant",
        "content": [{"type": "thinking", "thinking": "Hm"}, {"type": "text", "text": "Hello"}],
        "tool_plan": "zoom in",
        "tool_calls": [call],
    }
    answer = {"id": "c", "finish_reason": "TOOL_CALL", "message": message}
    usage, _, _ = track(C, json.dumps(answer).encode(), streaming=False)
    assert (usage.completion_tokens, usage.reported) == (
        tk("Hm", "Hello", "zoom in", "zoom", '{"f":2}'),
        False,
    )


def test_cohere_s_error_body_is_an_error() -> None:
    _, tracker, _ = track(C, json.dumps({"message": "bad", "id": "r"}).encode(), streaming=False)
    assert tracker.error_seen


def stream(*events: dict[str, Any]) -> bytes:
    return sse(*((None, e) for e in events), (None, "[DONE]"))


def delta(kind: str, message: dict[str, Any]) -> dict[str, Any]:
    return {"type": kind, "index": 0, "delta": {"message": message}}


EVENTS: list[dict[str, Any]] = [
    {"id": "c", "type": "message-start", "delta": {"message": {"role": "assistant"}}},
    delta("content-start", {"content": {"type": "text", "text": ""}}),
    delta("content-delta", {"content": {"text": "The"}}),
    delta("content-delta", {"content": {"thinking": " river"}}),
    {
        "type": "citation-start",
        "index": 0,
        "delta": {"message": {"citations": {"text": "river", "start": 4}}},
    },
    {"type": "content-end", "index": 0},
    delta("tool-plan-delta", {"tool_plan": " plan"}),
    delta("tool-call-start", {"tool_calls": {"id": "t", "function": {"name": "zoom", "arguments": ""}}}),
    delta("tool-call-delta", {"tool_calls": {"function": {"arguments": "{}"}}}),
    {"type": "tool-call-end", "index": 0},
]


def test_a_stream_settles_to_message_end_and_counts_generated_text_until_then() -> None:
    end = {"id": "c", "type": "message-end", "delta": {"finish_reason": "COMPLETE", "usage": USAGE}}
    for step in (0, 7):
        usage, tracker, out = track(C, stream(*EVENTS, end), step=step, strip=True)
        assert (usage.prompt_tokens, usage.completion_tokens, usage.reported) == (12, 5, True)
        assert tracker.done_seen and not tracker.error_seen
        assert out == stream(*EVENTS, end)  # nothing is stripped: vLLM always streams the usage
    cut, tracker, _ = track(C, sse(*((None, e) for e in EVENTS)))
    assert (cut.completion_tokens, cut.reported, tracker.done_seen) == (
        tk("The", " river", " plan", "zoom", "{}"),
        False,
        False,
    )


def test_a_failed_stream_ends_with_an_error_message_end() -> None:
    end = {"type": "message-end", "delta": {"error": "engine died", "finish_reason": "ERROR"}}
    _, tracker, _ = track(C, stream(*EVENTS[:3], end))
    assert tracker.error_seen


@pytest.mark.parametrize(
    ("value", "count"),
    [(12, 12), (12.0, 12), (0.0, 0), (12.5, None), (-1.0, None), (True, None), ("3", None)],
)
def test_counts_are_whole_non_negative_numbers(value: Any, count: int | None) -> None:
    assert count_number(value) == count


# ------------------------------------------------------------------------------------------------------------
# refusals


def test_refusals_use_cohere_s_envelope_and_keep_status_and_headers() -> None:
    status = RateLimitStatus(limit_requests=1, remaining_requests=0, limit_tokens=100, remaining_tokens=0)
    openai_shaped = refusals.rate_limited(Rejection(Reason.TOKENS, "tenant:a", 2.5, status=status), "m", 500)
    rendered = render_refusal(C, openai_shaped)
    assert json.loads(rendered.body) == {"message": json.loads(openai_shaped.body)["error"]["message"]}
    assert (rendered.status, rendered.headers, rendered.reason) == (
        429,
        openai_shaped.headers,
        openai_shaped.reason,
    )
