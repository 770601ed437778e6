"""Anthropic Messages (`POST /v1/messages`), as vLLM and SGLang serve it.

Counting rule: the server converts the request to a chat request and renders it with the chat template
(vLLM v0.33.0 entrypoints/anthropic/serving.py:352-660): `system` (a string, or text blocks joined) becomes
a leading system message; each message keeps its role; blocks become content: `text` as text, `image` as an
image item, `tool_use` as a tool call (its name, id and `json.dumps(input)`), `tool_result` in a user message
as an extra tool message (its text joined, its images an extra user message), `thinking` as reasoning text,
`redacted_thinking` dropped, `tool_reference` as its name. Every such string is counted, images are charged
the model's media cost, `tools` are rendered as compact JSON, and every message, extra ones included, is
charged the template's per-message overhead.

`max_tokens` is required (vLLM v0.33.0 entrypoints/anthropic/protocol.py:245, as Anthropic's API does) and
is the output bound. Block types outside vLLM's list (protocol.py:68-78), `document` and `search_result`
among them, are refused as vLLM refuses them. There is no `priority` field: the class priority can only
reach the backend as vLLM's `X-Vllm-Priority` header.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from extproc.admission.apis.common import drop_priority
from extproc.admission.apis.openai import ContentTexts, entries, required_messages, template_inputs
from extproc.admission.apis.spec import BOTH, ApiSpec, path, reenveloped, refused_message, shared
from extproc.admission.replies.verdicts import Refusal
from extproc.admission.vocabulary import fields as f
from extproc.admission.vocabulary.parsed import Api, BodyEdits, ParsedRequest, StepWork
from extproc.admission.vocabulary.prompt import Media, Prompt
from extproc.admission.vocabulary.readspec import COMMON_ERRORS, ReadSpec, event_type
from extproc.admission.vocabulary.usage import Observed, count_int

ROLES = ("user", "assistant", "system")
"""Message roles vLLM accepts (vLLM v0.33.0 entrypoints/anthropic/protocol.py:123)."""

BLOCK_TYPES = frozenset(
    {
        "text",
        "image",
        "tool_use",
        "tool_result",
        "tool_reference",
        "thinking",
        "redacted_thinking",
        "tool_addition",
        "tool_removal",
    }
)
"""Content-block types vLLM accepts (vLLM v0.33.0 entrypoints/anthropic/protocol.py:68-78)."""

IMAGE = Media(images=1)


class _Blocks:
    """Collects the texts, images and rendered messages of an Anthropic request, validating each block."""

    def __init__(self) -> None:
        self.collected = ContentTexts()

    def turn(self, role: str) -> None:
        self.collected.messages += 1
        self.collected.texts.append(role)

    def text(self, value: Any, param: str) -> None:
        self.collected.add_value(value, param)

    def add_message(self, message: Any, param: str) -> None:
        if not isinstance(message, dict):
            f.bad(
                f"'{param}' must be an object, got {f.json_type(message)}.", code="invalid_type", param=param
            )
        role = f.required_str(message, "role", f"{param}.role")
        if role not in ROLES:
            f.bad(
                f"'{param}.role' must be one of {', '.join(ROLES)}, got {role!r}.",
                code="invalid_value",
                param=f"{param}.role",
            )
        self.turn(role)
        self.add_content(message.get("content"), role, f"{param}.content")

    def add_content(self, content: Any, role: str, param: str) -> None:
        if isinstance(content, str):
            self.text(content, param)
            return
        if content is None:
            f.bad(f"Missing required parameter: '{param}'.", code="missing_field", param=param)
        if not isinstance(content, list):
            f.bad(
                f"'{param}' must be a string or an array of content blocks, got {f.json_type(content)}.",
                code="invalid_type",
                param=param,
            )
        for j, block in enumerate(content):
            self.add_block(block, role, f"{param}[{j}]")

    def add_block(self, block: Any, role: str, param: str) -> None:
        if not isinstance(block, dict):
            f.bad(f"'{param}' must be an object, got {f.json_type(block)}.", code="invalid_type", param=param)
        kind = f.required_str(block, "type", f"{param}.type")
        if kind not in BLOCK_TYPES:
            f.bad(
                f"Content blocks of type '{kind}' are not supported by this server.",
                code="invalid_value",
                param=f"{param}.type",
            )
        if kind == "text":
            self.text(f.required_str(block, "text", f"{param}.text"), f"{param}.text")
        elif kind == "image":
            f.opt_object(block, "source", f"{param}.source")
            self.collected.media = self.collected.media + IMAGE
        elif kind == "tool_use":
            self._tool_use(block, param)
        elif kind == "tool_result":
            self._tool_result(block, role, param)
        elif kind == "thinking":
            self.text(block.get("thinking"), f"{param}.thinking")
        elif kind == "tool_reference":
            self.text(block.get("tool_name") or block.get("name"), f"{param}.tool_name")
        elif kind in ("tool_addition", "tool_removal"):
            if role != "system":
                # vLLM v0.33.0 entrypoints/anthropic/protocol.py:110-118
                f.bad(
                    f'{kind} blocks are only allowed in messages with role "system".',
                    code="invalid_value",
                    param=f"{param}.type",
                )
            self.text(block.get("tool"), f"{param}.tool")
        # redacted_thinking: dropped by the server (serving.py:521-526), so not counted

    def _tool_use(self, block: dict[str, Any], param: str) -> None:
        """A tool call: vLLM renders `json.dumps(input)` with default separators (serving.py:537-548)."""
        self.text(block.get("name"), f"{param}.name")
        self.text(block.get("id"), f"{param}.id")
        arguments = f.opt_object(block, "input", f"{param}.input") or {}
        try:
            self.text(json.dumps(arguments), f"{param}.input")
        except (RecursionError, ValueError):
            f.bad(f"'{param}.input' nests too deeply.", code="invalid_value", param=f"{param}.input")

    def _tool_result(self, block: dict[str, Any], role: str, param: str) -> None:
        """In a user message: a tool message of its text, plus a user message of its images
        (serving.py:567-625); elsewhere the text `Tool result: ...` in the message itself."""
        content = block.get("content")
        if role != "user":
            self.text("Tool result: ", param)
            self.text(content, f"{param}.content")
            return
        self.turn("tool")
        self.text(block.get("tool_use_id"), f"{param}.tool_use_id")
        if not isinstance(content, list):
            self.text(content, f"{param}.content")
            return
        images = 0
        for k, item in enumerate(content):
            where = f"{param}.content[{k}]"
            if not isinstance(item, dict):
                f.bad(f"'{where}' must be an object.", code="invalid_type", param=where)
            if item.get("type") == "image":
                images += 1
            else:
                self.text(item.get("text") or item.get("tool_name") or item.get("name"), f"{where}.text")
        if images:
            self.turn("user")
            self.collected.media = self.collected.media + Media(images=images)


def messages_prompt(body: Mapping[str, Any]) -> Prompt:
    """The prompt the server renders from `system`, `messages` and `tools`."""
    blocks = _Blocks()
    system = body.get("system")
    if system is not None:
        blocks.turn("system")
        blocks.add_content(system, "system", "system")
    for i, message in enumerate(required_messages(body)):
        blocks.add_message(message, f"messages[{i}]")
    tools = f.opt_list(body, "tools", "tools")
    if tools:
        blocks.text(tools, "tools")
    # vLLM v0.32.0 entrypoints/anthropic/protocol.py:293 passes `chat_template_kwargs` to the template.
    blocks.collected.texts.extend(template_inputs(body, ()))
    c = blocks.collected
    return Prompt(texts=tuple(c.texts), messages=c.messages, templated=True, media=c.media)


class MessagesAdapter:
    api = Api("messages")

    def parse(self, body: dict[str, Any]) -> ParsedRequest:
        model = f.model_name(body)
        requested = f.opt_int(body, "max_tokens", low=1, high=f.MAX_TOKENS_LIMIT)
        if requested is None:
            f.bad("Missing required parameter: 'max_tokens'.", code="missing_field", param="max_tokens")
        return ParsedRequest(
            api=self.api,
            model=model,
            prompts=(messages_prompt(body),),
            stream=bool(f.opt_bool(body, "stream", "stream")),
            requested_max_tokens=requested,
            max_tokens_param="max_tokens",
            prompt_param="messages",
            work=StepWork(stop=entries(body.get("stop_sequences")), stop_param="stop_sequences"),
            body=body,
        )

    def edit(self, req: ParsedRequest, body: dict[str, Any], edits: BodyEdits) -> bool:
        return drop_priority(body, edits)


# ----------------------------------------------------------------------------------------------------
# Anthropic: events and bodies


def _usage(seen: Observed, usage: Any) -> None:
    """Anthropic usage: the prompt is `input_tokens` plus the cache reads and writes, which vLLM subtracts
    from it when prompt-token details are on (vLLM v0.33.0 entrypoints/anthropic/serving.py:75-111; 0.32.0
    the same, 70-98), and the cache reads are its cached prompt tokens."""
    if not isinstance(usage, dict):
        return
    seen.usage_seen = True
    prompt = count_int(usage.get("input_tokens"))
    if prompt is not None:
        for key in ("cache_read_input_tokens", "cache_creation_input_tokens"):
            prompt += count_int(usage.get(key)) or 0
    seen.prompt = prompt
    seen.cached = count_int(usage.get("cache_read_input_tokens"))
    seen.completion = count_int(usage.get("output_tokens"))


DELTA_TEXT_KEYS = ("text", "thinking", "partial_json")
"""Generated text in a `content_block_delta`: `text_delta`, `thinking_delta`, `input_json_delta`."""


class MessagesDialect:
    """Anthropic SSE (`event:` + `data:`; vLLM v0.33.0 entrypoints/anthropic/serving.py:918-1247) and bodies.

    `message_start` carries the prompt's usage, `content_block_delta` the generated text, `message_delta` the
    cumulative `output_tokens`, `message_stop` ends a complete answer, `error` a failed one.
    """

    def event(self, name: bytes, obj: Mapping[str, Any]) -> Observed:
        kind = obj.get("type")
        if not isinstance(kind, str):
            kind = name.decode("utf-8", "replace")
        seen = Observed(error=kind == "error")
        if kind == "message_start":
            message = obj.get("message")
            if isinstance(message, dict):
                _usage(seen, message.get("usage"))
        elif kind == "content_block_start":
            block = obj.get("content_block")
            if (
                isinstance(block, dict)
                and block.get("type") == "tool_use"
                and isinstance(block.get("name"), str)
            ):
                seen.texts.append(block["name"])
        elif kind == "content_block_delta":
            delta = obj.get("delta")
            if isinstance(delta, dict):
                for key in DELTA_TEXT_KEYS:
                    value = delta.get(key)
                    if isinstance(value, str):
                        seen.texts.append(value)
        elif kind == "message_delta":
            _usage(seen, obj.get("usage"))
        elif kind == "message_stop":
            seen.final = True
        return seen

    def body(self, obj: Any) -> Observed:
        if not isinstance(obj, dict):
            return Observed()
        seen = Observed(error=obj.get("type") == "error" or obj.get("error") is not None)
        content = obj.get("content")
        if isinstance(content, list):
            for block in content:
                if isinstance(block, dict):
                    _block_texts(block, seen.texts)
        _usage(seen, obj.get("usage"))
        return seen


def _block_texts(block: Mapping[str, Any], texts: list[str]) -> None:
    for key in ("text", "thinking", "name"):
        value = block.get(key)
        if isinstance(value, str):
            texts.append(value)
    if isinstance(block.get("input"), dict):
        texts.append(json.dumps(block["input"]))


MESSAGES_DIALECT = MessagesDialect()


# ----------------------------------------------------------------------------------------------------
# Anthropic: refusals

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}
"""Anthropic's `error.type` per HTTP status, as vLLM maps them (vLLM v0.33.0
entrypoints/anthropic/protocol.py:34-54)."""


def error_type(status: int) -> str:
    return ERROR_TYPES.get(status) or ("api_error" if status >= 500 else "invalid_request_error")


def anthropic_refusal(refusal: Refusal) -> Refusal:
    """The same refusal in Anthropic's error envelope `{"type": "error", "error": {"type", "message"}}`.

    Status and headers are kept: Anthropic SDKs choose the exception by status and back off on 429 with
    `retry-after`, honouring `x-should-retry` (anthropic-python 2.14 `_base_client.py` `_should_retry`).
    """
    error = {"type": error_type(refusal.status), "message": refused_message(refusal)}
    return reenveloped(refusal, {"type": "error", "error": error})


# `content_block_delta` carries the text, `message_start` the prompt's usage, `message_delta` the output's,
# `message_stop` ends the answer.
MESSAGES_SPEC = ReadSpec(
    content=(event_type("content_block_delta"),),
    final=(event_type("message_stop"),),
    error=(*COMMON_ERRORS, event_type("error")),
)

SPEC = ApiSpec(
    adapter=MessagesAdapter(),
    dialect=shared(MESSAGES_DIALECT),
    read=MESSAGES_SPEC,
    paths=(path("/v1/messages", "generates (Anthropic Messages)", BOTH),),
    render_refusal=anthropic_refusal,
)
