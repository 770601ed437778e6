"""Refusals raised before a request reaches the upstream, rendered the way OpenAI clients expect.

OpenAI SDKs parse `{"error": {"message", "type", "param", "code"}}` and surface `message`, `param` and `code`
to the caller, so a refusal from the sidecar looks exactly like one from the API: the client's existing error
handling (e.g. shrinking the prompt on `context_length_exceeded`) keeps working.
"""

from __future__ import annotations

import json

INVALID_REQUEST = "invalid_request_error"


class AdmissionError(Exception):
    """A request refused before it reaches the upstream; carries the HTTP status and an OpenAI-style error."""

    status: int
    message: str
    type: str
    code: str | None
    param: str | None

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = INVALID_REQUEST,
        code: str | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param

    def body(self) -> bytes:
        """The JSON body to send with `status` (see `error_body`)."""
        return error_body(self.message, type=self.type, code=self.code, param=self.param)

    def __repr__(self) -> str:
        return (
            f"AdmissionError(status={self.status}, code={self.code!r}, param={self.param!r}, "
            f"message={self.message!r})"
        )


def error_body(message: str, *, type: str, code: str | None = None, param: str | None = None) -> bytes:
    """OpenAI's error envelope with all four keys present (null when absent), as SDKs index them directly.

    `ensure_ascii` keeps the body valid UTF-8 even if the message quotes text holding a lone surrogate.
    """
    payload = {"error": {"message": message, "type": type, "param": param, "code": code}}
    return json.dumps(payload, separators=(",", ":"), ensure_ascii=True).encode("ascii")
