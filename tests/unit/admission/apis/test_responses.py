"""OpenAI Responses: validation, counting every rendered part, tool-loop bounds, edits and the SSE dialect."""

from __future__ import annotations

import json
from typing import Any

import pytest

from extproc.admission.intake.request import Api, BodyEdits
from extproc.admission.intake.reservation import Reservation, prompt_token_lower_bound
from extproc.admission.vocabulary.policy import MediaCosts, MissingMaxTokens, ModelPolicy, TemplateCosts
from tests.unit.admission.apis_helpers import BARE, counts, edited, parse, plan, refused, sse, tk, track

R = Api("responses")


def body(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "input": "Tell me a story.", **fields}


# ------------------------------------------------------------------------------------------------------------
# counting


def test_instructions_and_a_string_input_are_two_templated_messages() -> None:
    req = parse(R, body(instructions="Be brief."))
    assert counts(req) == [tk("system", "Be brief.", "user", "Tell me a story.")]
    framed = ModelPolicy(1_000_000, template=TemplateCosts(per_message=3, per_request=3))
    assert counts(req, framed) == [tk("system", "Be brief.", "user", "Tell me a story.") + 2 * 3 + 3]
    assert req.prompt_param == "input" and req.max_tokens_param == "max_output_tokens"


def test_every_item_of_the_input_is_counted() -> None:
    items = [
        {
            "role": "user",
            "content": [
                {"type": "input_text", "text": "What is 2+2?"},
                {"type": "input_image", "image_url": "https://x/y.png"},
            ],
        },
        {"role": "assistant", "content": [{"type": "output_text", "text": "Let me check."}]},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "add them"}]},
        {"type": "function_call", "call_id": "c1", "name": "add", "arguments": '{"a":2,"b":2}'},
        {"type": "function_call_output", "call_id": "c1", "output": "4"},
        {"type": "custom_tool_call", "call_id": "c2", "name": "grep", "input": "needle"},
        {
            "type": "custom_tool_call_output",
            "call_id": "c2",
            "output": [{"type": "input_text", "text": "found"}],
        },
    ]
    tools = [{"type": "function", "name": "add", "parameters": {"type": "object"}}]
    image = 777
    policy = ModelPolicy(1_000_000, template=TemplateCosts(0, 0), media=MediaCosts(image_tokens=image))
    req = parse(R, body(input=items, tools=tools))
    expected = tk(
        "user", "What is 2+2?",
        "assistant", "Let me check.",
        "assistant", "add them",
        "assistant", "c1", "add", '{"a":2,"b":2}',
        "tool", "c1", "4",
        "assistant", "c2", "grep", "needle",
        "tool", "c2", "found",
        json.dumps(tools, separators=(",", ":"), sort_keys=True),
    )  # fmt: skip
    assert counts(req, policy) == [expected + image]
    assert req.prompts[0].messages == 7


@pytest.mark.parametrize(
    ("fields", "code", "param"),
    [
        ({"input": None}, "missing_field", "input"),
        ({"input": 3}, "invalid_type", "input"),
        ({"input": ["hi"]}, "invalid_type", "input[0]"),
        ({"input": [{"type": "web_search_call", "id": "w"}]}, "invalid_value", "input[0].type"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "invalid_value", "input[0].type"),
        (
            {"input": [{"type": "reasoning", "encrypted_content": "gAAA"}]},
            "unsupported_parameter",
            "input[0].encrypted_content",
        ),
        (
            {"input": [{"type": "function_call", "call_id": "c", "arguments": "{}"}]},
            "missing_field",
            "input[0].name",
        ),
        (
            {"input": [{"type": "function_call", "call_id": "c", "name": "f"}]},
            "missing_field",
            "input[0].arguments",
        ),
        ({"input": [{"role": "user"}]}, "missing_field", "input[0].content"),
        ({"input": [{"content": "x"}]}, "missing_field", "input[0].role"),
        ({"instructions": 5}, "invalid_type", "instructions"),
        ({"max_output_tokens": 0}, "invalid_value", "max_output_tokens"),
        ({"max_output_tokens": True}, "invalid_type", "max_output_tokens"),
        ({"stream": "yes"}, "invalid_type", "stream"),
        ({"background": True}, "unsupported_parameter", "background"),
        ({"tools": {"type": "function"}}, "invalid_type", "tools"),
        ({"tools": [{"name": "f"}]}, "missing_field", "tools[0].type"),
        ({"tools": [{"type": "web_search_preview"}]}, "missing_field", "max_tool_calls"),
        ({"tools": [{"type": "code_interpreter"}], "max_tool_calls": 129}, "invalid_value", "max_tool_calls"),
        ({"previous_response_id": "resp_1"}, "unsupported_parameter", "previous_response_id"),
        ({"model": None}, "missing_field", "model"),
    ],
)
def test_validation_names_the_field(fields: dict[str, Any], code: str, param: str) -> None:
    err = refused(R, body(**fields))
    assert (err.code, err.param) == (code, param)
    assert param.split("[")[0].split(".")[0] in err.message or code == "missing_field"


# ------------------------------------------------------------------------------------------------------------
# bounds


def test_the_output_bound_is_max_output_tokens_else_the_rest_of_the_window() -> None:
    policy = ModelPolicy(context_window=1000, template=TemplateCosts(0, 0))
    prompt = tk("user", "Tell me a story.")
    assert plan(R, body(max_output_tokens=100), policy) == Reservation(prompt, 100)
    assert plan(R, body(), policy) == Reservation(prompt, 1000 - prompt)
    inject = ModelPolicy(1000, template=TemplateCosts(0, 0), missing_max_tokens=MissingMaxTokens.INJECT)
    assert plan(R, body(), inject).injected_max_tokens == min(1024, 1000 - prompt)


def test_built_in_tools_hold_a_whole_window_per_allowed_call() -> None:
    policy = ModelPolicy(context_window=4096, template=TemplateCosts(0, 0))
    tools = [{"type": "function", "name": "f"}, {"type": "web_search_preview"}]
    req = parse(R, body(tools=tools, max_tool_calls=2, max_output_tokens=50))
    assert len(req.prompts) == 3 and [p.opaque for p in req.prompts] == [False, True, True]
    first = counts(req, policy)[0]
    got = plan(R, body(tools=tools, max_tool_calls=2, max_output_tokens=50), policy)
    # the first turn is counted; each later turn re-prefills a conversation grown by unbounded tool output
    assert got == Reservation(first + 2 * (4096 - 50), 3 * 50)
    assert got.total == first + 50 + 2 * 4096


def test_client_side_tools_need_no_call_bound() -> None:
    tools = [
        {"type": "function", "name": "f"},
        {"type": "custom", "name": "g"},
        {"type": "namespace", "name": "n"},
    ]
    assert len(parse(R, body(tools=tools)).prompts) == 1
    assert len(parse(R, body(tools=[{"type": "mcp", "server_label": "x"}], max_tool_calls=0)).prompts) == 1


def test_a_stored_conversation_is_opaque_when_allowed() -> None:
    req = parse(R, body(previous_response_id="resp_1", max_output_tokens=100), allow_stored_context=True)
    assert req.stored_context == "previous_response_id" and req.prompts[0].opaque
    policy = ModelPolicy(context_window=8192)
    assert prompt_token_lower_bound(req, policy) == 0
    got = plan(
        R, body(previous_response_id="resp_1", max_output_tokens=100), policy, allow_stored_context=True
    )
    assert got == Reservation(8192 - 100, 100)


# ------------------------------------------------------------------------------------------------------------
# edits


def test_edits_write_max_output_tokens_and_the_priority() -> None:
    out = edited(R, body(priority=-5), BodyEdits(max_tokens=256, strip_priority=True, priority=3))
    assert out is not None and out["max_output_tokens"] == 256 and out["priority"] == 3
    out = edited(R, body(max_output_tokens=10, priority=-5), BodyEdits(max_tokens=256, strip_priority=True))
    assert out is not None and out["max_output_tokens"] == 10 and "priority" not in out
    # usage is always in the terminal event: nothing to ask for
    assert edited(R, body(stream=True), BodyEdits(include_usage=True)) is None


# ------------------------------------------------------------------------------------------------------------
# dialect

USAGE = {"input_tokens": 31, "output_tokens": 9, "total_tokens": 40}
DELTAS = ["Once", " upon", " a", " time"]


def stream(terminal: str = "response.completed", usage: Any = USAGE) -> bytes:
    shell = {"id": "resp_1", "object": "response", "status": "in_progress", "usage": None}
    events: list[tuple[str | None, Any]] = [
        ("response.created", {"type": "response.created", "sequence_number": 0, "response": shell}),
        ("response.in_progress", {"type": "response.in_progress", "sequence_number": 1, "response": shell}),
        ("response.reasoning_text.delta", {"type": "response.reasoning_text.delta", "delta": "thinking"}),
        ("response.output_item.added", {"type": "response.output_item.added", "item": {"type": "message"}}),
    ]
    events += [
        ("response.output_text.delta", {"type": "response.output_text.delta", "delta": d}) for d in DELTAS
    ]
    events += [
        ("response.output_text.done", {"type": "response.output_text.done", "text": "".join(DELTAS)}),
        (
            "response.output_item.added",
            {"type": "response.output_item.added", "item": {"type": "function_call", "name": "lookup"}},
        ),
        (
            "response.function_call_arguments.delta",
            {"type": "response.function_call_arguments.delta", "delta": '{"q":1}'},
        ),
        (
            "response.output_item.done",
            {
                "type": "response.output_item.done",
                "item": {"type": "message", "content": [{"text": "x" * 50}]},
            },
        ),
    ]
    if terminal:
        final = {**shell, "status": "completed", "usage": usage}
        events.append((terminal, {"type": terminal, "response": final}))
    return sse(*events)


COUNTED = tk("thinking", *DELTAS, "lookup", '{"q":1}')


@pytest.mark.parametrize("step", [0, 1, 7, 64])
def test_the_terminal_event_settles_exactly_however_the_stream_is_cut(step: int) -> None:
    usage, tracker, out = track(R, stream(), step=step)
    assert (usage.prompt_tokens, usage.completion_tokens, usage.reported) == (31, 9, True)
    assert tracker.done_seen and not tracker.error_seen
    assert out == stream()


def test_the_cached_input_tokens_are_read_from_the_terminal_event() -> None:
    """vLLM writes `input_tokens_details.cached_tokens` in every Responses usage; it is part of the input."""
    detailed = {**USAGE, "input_tokens_details": {"cached_tokens": 16}}
    usage, _, _ = track(R, stream(usage=detailed), step=7)
    assert (usage.prompt_tokens, usage.cached_prompt_tokens) == (31, 16)
    assert track(R, stream())[0].cached_prompt_tokens is None


def test_without_usage_only_the_deltas_are_counted() -> None:
    usage, tracker, _ = track(R, stream(usage=None))
    assert (usage.completion_tokens, usage.reported) == (COUNTED, False)
    assert tracker.done_seen
    usage, tracker, _ = track(R, stream(terminal=""))  # cut before the end
    assert usage.completion_tokens == COUNTED and not tracker.done_seen


def test_incomplete_is_final_and_failed_is_an_error() -> None:
    usage, tracker, _ = track(R, stream("response.incomplete"))
    assert usage.completion_tokens == 9 and tracker.done_seen and not tracker.error_seen
    _, tracker, _ = track(R, stream("response.failed", usage={"input_tokens": 31, "output_tokens": 2}))
    assert tracker.error_seen
    _, tracker, _ = track(R, sse(("error", {"type": "error", "code": "server_error", "message": "boom"})))
    assert tracker.error_seen


def test_a_json_body_reports_usage_and_errors() -> None:
    answer = {
        "id": "resp_1",
        "object": "response",
        "status": "completed",
        "error": None,
        "output": [
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hi there"}]}
        ],
        "usage": USAGE,
    }
    usage, tracker, _ = track(R, json.dumps(answer).encode(), streaming=False)
    assert (usage.prompt_tokens, usage.completion_tokens) == (31, 9) and not tracker.error_seen
    usage, _, _ = track(R, json.dumps({**answer, "usage": None}).encode(), streaming=False)
    assert (usage.completion_tokens, usage.reported) == (tk("Hi there"), False)
    error = {"error": {"message": "bad", "type": "BadRequestError", "code": 400}}
    _, tracker, _ = track(R, json.dumps(error).encode(), streaming=True)
    assert tracker.error_seen


def test_bare_policy_has_no_template_cost() -> None:
    assert BARE.template == TemplateCosts(0, 0)
