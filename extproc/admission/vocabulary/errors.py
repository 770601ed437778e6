"""Refusals raised before a request reaches the upstream, rendered the way OpenAI clients expect.

OpenAI SDKs parse `{"error": {"message", "type", "param", "code"}}` and surface `message`, `param` and `code`
to the caller, so a refusal from the sidecar looks exactly like one from the API: the client's existing error
handling (e.g. shrinking the prompt on `context_length_exceeded`) keeps working.
"""

from __future__ import annotations

import json

INVALID_REQUEST = "invalid_request_error"

RATE_LIMIT_EXCEEDED = "rate_limit_exceeded"
"""The `code` of every 429 for capacity, as OpenAI's: clients and dashboards key on it to back off."""

REQUESTS_LIMIT = "requests"
"""The `type` of a 429 for want of a request slot (concurrency, a queue, a deadline), OpenAI's name."""

TOKENS_LIMIT = "tokens"
"""The `type` of a 429 for want of tokens per minute (a TPM bucket, split or whole), OpenAI's name."""

KV_CACHE_LIMIT = "kv_cache"
"""The `type` of a 429 from the KV budget: the engines' KV cache cannot hold the request now. Not `tokens`,
which OpenAI gives a TPM limit: a client or an operator reading `tokens` would look at the tokens-per-minute
limit, which did not refuse, and shrinking the request's TPM share would not help either. The SDKs choose
their exception by the status (429 stays `RateLimitError`) and retry on `retry-after`, never by `type`, so a
type of its own changes nothing for them."""


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
