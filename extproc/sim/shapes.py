"""Requests of the APIs vLLM serves beside chat and completions, turned into the simulator's `ParsedRequest`.

vLLM renders Responses and Anthropic Messages requests as chat conversations (vLLM v0.33.0
entrypoints/openai/responses/utils.py:263-305, entrypoints/anthropic/serving.py:352-660), so the simulator
converts them to chat messages and counts them with the chat rule: their usage is exact and consistent with
a chat request's. Token-in/token-out (`/inference/v1/generate`) is a completion over token ids. Pooling
requests (embeddings, classify, score, rerank) are counted here and answered without decoding.
"""

from __future__ import annotations

import json
from typing import Any

from extproc.admission.vocabulary.tokens import count_chat_prompt, count_text
from extproc.sim.protocol import (
    ParsedRequest,
    bad_request,
    check_model,
    optional_int,
    output_override,
    stream_flags,
)


def _require_object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise bad_request("Request body must be a JSON object")
    return body


def _text_of(content: Any) -> Any:
    """A Responses or Anthropic content as chat content: strings stay, block lists keep their text parts."""
    if not isinstance(content, list):
        return content
    parts = []
    for part in content:
        if isinstance(part, dict) and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
    return parts


def responses_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """`instructions` and `input` as chat messages, following vLLM's conversion."""
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if isinstance(instructions, str) and instructions:
        messages.append({"role": "system", "content": instructions})
    value = body.get("input")
    if isinstance(value, str):
        messages.append({"role": "user", "content": value})
        return messages
    if not isinstance(value, list):
        raise bad_request("'input' is required: a string or a list of input items", "input")
    for item in value:
        if not isinstance(item, dict):
            raise bad_request("input items must be objects", "input")
        kind = item.get("type")
        if kind in (None, "message"):
            messages.append({"role": item.get("role", "user"), "content": _text_of(item.get("content"))})
        elif kind == "function_call":
            call = {
                "id": item.get("call_id"),
                "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments")},
            }
            messages.append({"role": "assistant", "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "content": item.get("output")})
        else:
            raise bad_request(f"Unsupported input item type: {kind}", "input")
    return messages


def parse_responses(body: Any, header_override: str | None, served_model: str) -> ParsedRequest:
    body = _require_object(body)
    check_model(body, served_model)
    messages = responses_messages(body)
    tools = body.get("tools") or None
    chat_body = {"messages": messages, "tools": tools}
    return ParsedRequest(
        True,
        chat_body,
        1,
        bool(body.get("stream", False)),
        False,
        optional_int(body, "max_output_tokens", 1),
        output_override(body, header_override),
    )


def messages_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """`system` and `messages` as chat messages, following vLLM's conversion (text, tool use and results)."""
    out: list[dict[str, Any]] = []
    system = body.get("system")
    if isinstance(system, list):
        system = "".join(b.get("text", "") for b in system if isinstance(b, dict))
    if isinstance(system, str) and system:
        out.append({"role": "system", "content": system})
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list of messages", "messages")
    for message in messages:
        if not isinstance(message, dict):
            raise bad_request("messages must be objects", "messages")
        content = message.get("content")
        if not isinstance(content, list):
            out.append({"role": message.get("role"), "content": content})
            continue
        entry: dict[str, Any] = {"role": message.get("role")}
        parts = []
        for block in content:
            if not isinstance(block, dict):
                continue
            if block.get("type") == "text":
                parts.append({"type": "text", "text": block.get("text", "")})
            elif block.get("type") == "tool_use":
                function = {"name": block.get("name"), "arguments": json.dumps(block.get("input") or {})}
                entry.setdefault("tool_calls", []).append(
                    {"id": block.get("id"), "type": "function", "function": function}
                )
            elif block.get("type") == "tool_result":
                out.append({"role": "tool", "content": _text_of(block.get("content"))})
        if parts:
            entry["content"] = parts
        out.append(entry)
    return out


def parse_messages(body: Any, header_override: str | None, served_model: str) -> ParsedRequest:
    body = _require_object(body)
    check_model(body, served_model)
    max_tokens = optional_int(body, "max_tokens", 1)
    if max_tokens is None:
        raise bad_request("max_tokens: Field required", "max_tokens")
    chat_body = {"messages": messages_messages(body), "tools": body.get("tools") or None}
    return ParsedRequest(
        True,
        chat_body,
        1,
        bool(body.get("stream", False)),
        False,
        max_tokens,
        output_override(body, header_override),
    )


def parse_cohere_chat(body: Any, header_override: str | None, served_model: str) -> ParsedRequest:
    """Cohere chat v2: its messages as chat messages (`developer` as `system`, text blocks kept), one
    sequence bounded by `max_tokens`, usage always streamed (vLLM v0.32.0 entrypoints/cohere/serving.py:
    369-586)."""
    body = _require_object(body)
    check_model(body, served_model)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise bad_request("messages must contain at least one message", "messages")
    chat = [
        {
            "role": "system" if m.get("role") == "developer" else m.get("role"),
            "content": _text_of(m.get("content")),
        }
        for m in messages
    ]
    chat_body = {"messages": chat, "tools": body.get("tools") or None}
    stream = bool(body.get("stream", False))
    max_tokens = optional_int(body, "max_tokens", 1)
    return ParsedRequest(True, chat_body, 1, stream, True, max_tokens, output_override(body, header_override))


def parse_generate_tokens(body: Any, header_override: str | None, served_model: str) -> ParsedRequest:
    """`token_ids` and `sampling_params` (vLLM v0.33.0 scale_out/token_in_token_out/protocol.py:221-370)."""
    body = _require_object(body)
    check_model(body, served_model)
    ids = body.get("token_ids")
    if not isinstance(ids, list) or not ids or not all(type(t) is int and t >= 0 for t in ids):
        raise bad_request("'token_ids' must be a non-empty list of token ids", "token_ids")
    params = body.get("sampling_params")
    if not isinstance(params, dict):
        raise bad_request("sampling_params: Field required", "sampling_params")
    stream, include_usage = stream_flags(body)
    return ParsedRequest(
        False,
        {"prompt": ids},
        optional_int(params, "n", 1) or 1,
        stream,
        include_usage,
        optional_int(params, "max_tokens", 1),
        output_override(body, header_override),
    )


# ----------------------------------------------------------------------------------------------------
# Pooling


def _count_input(value: Any, encoding: str) -> int:
    if isinstance(value, str):
        return count_text(value, encoding)
    if isinstance(value, list) and all(type(t) is int for t in value):
        return len(value)
    raise bad_request("inputs must be strings or token-id lists", "input")


def pooling_prompts(body: Any, served_model: str, encoding: str) -> list[int]:
    """Prompt tokens of each prompt of an embeddings, classify, pooling, score or rerank request."""
    body = _require_object(body)
    check_model(body, served_model)
    if isinstance(body.get("messages"), list):
        return [count_chat_prompt(body["messages"], None, encoding)]
    value = body.get("input")
    if value is not None:
        items = value if isinstance(value, list) and not all(type(t) is int for t in value) else [value]
        return [_count_input(item, encoding) for item in items] or _empty()
    for first, second in (
        ("query", "documents"),
        ("queries", "documents"),
        ("text_1", "text_2"),
        ("data_1", "data_2"),
    ):
        if body.get(first) is None or body.get(second) is None:
            continue
        queries = body[first] if isinstance(body[first], list) else [body[first]]
        documents = body[second] if isinstance(body[second], list) else [body[second]]
        if len(queries) == 1:
            queries = queries * len(documents)
        if len(queries) != len(documents) or not documents:
            raise bad_request("Input lengths must be either 1:1, 1:N or N:N", second)
        return [
            _count_input(q, encoding) + _count_input(d, encoding)
            for q, d in zip(queries, documents, strict=True)
        ]
    raise bad_request("expected 'input', 'messages' or a query with documents", "input")


def _empty() -> list[int]:
    raise bad_request("'input' must not be empty", "input")
