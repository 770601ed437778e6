"""The rate-limit headers OpenAI clients understand, built from the limiter's view of a request's keys.

They follow OpenAI's conventions so the official SDKs back off by themselves: they honour `retry-after-ms`
and `retry-after` (when at most 60 s), and never retry when told `x-should-retry: false`, which the sidecar
sends for requests that can never fit.
"""

from __future__ import annotations

import math

from extproc.admission.replies.verdicts import Header
from extproc.admission.vocabulary.names import RATELIMIT_REQUEST_HEADERS, RATELIMIT_TOKEN_HEADERS
from extproc.core.limiter.limiter import RateLimitStatus


def format_duration(seconds: float) -> str:
    """OpenAI's reset format: `1m30s`, `6s`, `250ms`."""
    if seconds <= 0:
        return "0s"
    if seconds < 1:
        return f"{max(1, math.ceil(seconds * 1000))}ms"
    whole = math.ceil(seconds)
    minutes, secs = divmod(whole, 60)
    hours, minutes = divmod(minutes, 60)
    out = ""
    if hours:
        out += f"{hours}h"
    if hours or minutes:
        out += f"{minutes}m"
    return out + f"{secs}s"


def ratelimit_headers(status: RateLimitStatus) -> tuple[Header, ...]:
    """`x-ratelimit-{limit,remaining,reset}-{requests,tokens}` for the tightest key of the request."""
    headers: list[Header] = []
    if status.limit_requests is not None and status.remaining_requests is not None:
        reset = format_duration(status.reset_requests_s or 0.0)
        values = (str(status.limit_requests), str(status.remaining_requests), reset)
        headers.extend(zip(RATELIMIT_REQUEST_HEADERS, values, strict=True))
    if status.limit_tokens is not None and status.remaining_tokens is not None:
        reset = format_duration(status.reset_tokens_s or 0.0)
        values = (str(status.limit_tokens), str(status.remaining_tokens), reset)
        headers.extend(zip(RATELIMIT_TOKEN_HEADERS, values, strict=True))
    return tuple(headers)


def retry_headers(retry_after_s: float | None) -> tuple[Header, ...]:
    """`retry-after` in whole seconds (at least 1) plus the exact `retry-after-ms`; no retry when None."""
    if retry_after_s is None:
        return (("x-should-retry", "false"),)
    return (
        ("retry-after", str(max(1, math.ceil(retry_after_s)))),
        ("retry-after-ms", str(max(1, math.ceil(retry_after_s * 1000)))),
    )
