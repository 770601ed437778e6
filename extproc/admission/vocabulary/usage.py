"""What a response says it used: usage read from SSE and JSON answers, in each API's dialect (`Dialect`:
where generated text, usage, errors and the final event are; each API's module under
`extproc/admission/apis/` has one), as `Observed` per event or body and `Usage` in all. Settlement charges
from it (extproc/admission/capacity/charging.py); the inline profile's tracker that reads it as a response
streams is extproc/admission/tracking/usage_tracker.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True)
class Usage:
    """What a request consumed, as far as it is known."""

    prompt_tokens: int | None  # as reported by the backend, None if not reported
    completion_tokens: int  # reported, or counted from what passed
    reported: bool  # True when the backend's own usage object was seen
    cached_prompt_tokens: int | None = None  # of prompt_tokens, served from the prefix cache, if reported
    certain_completion: int | None = field(default=None, compare=False)
    """Of `completion_tokens`, those certainly generated: the reported count, and one per text that passed
    since (each delta carries a token at least) with the token ids; None where unknown (`completion_tokens`
    then). A floor: a tokenizer's count of the text may exceed the engine's tokens."""


def count_int(value: Any) -> int | None:
    """A token count as the backend reports it: a non-negative JSON integer, else unknown."""
    if type(value) is int and value >= 0:
        return value
    return None


@dataclass(slots=True)
class Observed:
    """What one SSE event or one JSON body says about usage, in a dialect-independent form.

    `texts` are generated texts to count when no usage is reported, `tokens` generated tokens known without
    tokenizing (token-id arrays); `prompt`/`completion`/`cached` are reported counts (`usage_seen` once any
    usage object was present; `cached` the prompt tokens the prefix cache served); `final` marks the event
    that ends a complete answer; `usage_only` marks the usage event a client did not ask for (it may be
    stripped).
    """

    texts: list[str] = field(default_factory=list)
    tokens: int = 0
    usage_seen: bool = False
    prompt: int | None = None
    completion: int | None = None
    cached: int | None = None
    error: bool = False
    final: bool = False
    usage_only: bool = False

    @classmethod
    def of_body(cls, obj: Mapping[str, Any]) -> Observed:
        """A JSON object's observation before its usage is read: an error when it is one as vLLM and
        SGLang send them (`{"error": {...}}`, or `{"object": "error", ...}` from older vLLM)."""
        return cls(error=obj.get("error") is not None or obj.get("object") == "error")


class Dialect(Protocol):
    """How one API's responses carry generated text and usage (OpenAI chunks, Responses events, ...)."""

    def event(self, name: bytes, obj: Mapping[str, Any]) -> Observed: ...

    def body(self, obj: Any) -> Observed:
        """A whole JSON body: usually an object; some APIs answer a batch as an array."""
        ...
