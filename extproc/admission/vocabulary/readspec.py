"""How the proxy's Lua filter reads an API's streamed answers in the lean profile: a `ReadSpec` of Lua
patterns, built from what the API's `Dialect` reads (extproc/admission/vocabulary/usage.py), and the patterns
every API shares. Each API's spec sits in its module under `extproc/admission/apis/`;
extproc/envoyconf/response.lua applies it and extproc/admission/tracking/reading.py reads back what it saw.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


def json_key(name: str) -> str:
    """A Lua pattern for a JSON key and its colon, with the optional spaces some servers write."""
    return f'"{name}"%s*:%s*'


def json_text(name: str) -> str:
    """A JSON string field with at least one character: `"content":""` (a role-only delta) is no content."""
    return json_key(name) + '"[^"]'


def event_type(name: str) -> str:
    """The `type` field of an event naming `name` (a Lua pattern: dots escaped by the caller)."""
    return json_key("type") + f'"{name}"'


COMMON_ERRORS = (
    json_key("error") + "{",  # {"error": {...}}: vLLM's ErrorResponse, SGLang, the simulator
    json_key("object") + '"error"',  # {"object": "error", ...}: older vLLM
    "^event:%s*error%s",  # an `event: error` line first in the event...
    "\nevent:%s*error%s",  # ...or after an `id:` line
)
"""Lua patterns of an error event any API may send. An escaped quote inside generated text (`\\"error\\":`)
never matches: the key's closing quote must follow the name directly."""

DONE = ("data:%s*%[DONE%]",)


@dataclass(frozen=True, slots=True)
class ReadSpec:
    """How the proxy's Lua filter reads one API's streamed answers: Lua patterns matched against each whole
    SSE event (its `event:` and `data:` lines).

    An event is a content event when it matches one of `content` and none of `not_content`; `final` marks
    the end of a complete answer, `error` a failed one. `usage_key` names the JSON key whose object value
    is captured as the usage. `usage_only` marks the usage event a client did not ask for (stripped when
    the sidecar injected `include_usage`).
    """

    content: tuple[str, ...]
    not_content: tuple[str, ...] = ()
    final: tuple[str, ...] = DONE
    error: tuple[str, ...] = COMMON_ERRORS
    usage_key: str = "usage"
    usage_only: str | None = None

    @property
    def usage_pattern(self) -> str:
        """Captures the key's object value with balanced braces (`%b{}`); `"usage": null` does not match."""
        return json_key(self.usage_key) + "(%b{})"

    def to_struct(self, strip: bool) -> dict[str, Any]:
        """The spec as the Lua filter reads it from dynamic metadata (lists become Lua arrays)."""
        out: dict[str, Any] = {
            "content": list(self.content),
            "not_content": list(self.not_content),
            "final": list(self.final),
            "error": list(self.error),
            "usage": self.usage_pattern,
            "usage_key": f'"{self.usage_key}"',
            "strip": strip,
        }
        if self.usage_only is not None:
            out["only"] = self.usage_only
        return out
