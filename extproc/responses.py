"""Building ext_proc replies and the rate-limit headers clients understand.

Header values are written to `raw_value`: Envoy 1.40 sends and expects raw bytes there, and rejects a
header that sets both `value` and `raw_value`.

The `x-ratelimit-*` and `retry-after` headers follow OpenAI's conventions, so the official SDKs back off by
themselves: they honour `retry-after-ms` and `retry-after` (when at most 60 s), and never retry when told
`x-should-retry: false`, which the sidecar sends for requests that can never fit.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3 import http_status_pb2

from extproc.core.limiter import RateLimitStatus

Header = tuple[str, str]

_MODE = processing_mode_pb2.ProcessingMode
PASSTHROUGH_MODE = _MODE(
    request_body_mode=_MODE.NONE,
    response_header_mode=_MODE.SKIP,
    response_body_mode=_MODE.NONE,
    request_trailer_mode=_MODE.SKIP,
    response_trailer_mode=_MODE.SKIP,
)
"""Mode override for requests that are not admitted here (e.g. GET /v1/models): no further messages."""


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


def ratelimit_headers(status: RateLimitStatus) -> list[Header]:
    headers: list[Header] = []
    if status.limit_requests is not None and status.remaining_requests is not None:
        headers.append(("x-ratelimit-limit-requests", str(status.limit_requests)))
        headers.append(("x-ratelimit-remaining-requests", str(status.remaining_requests)))
        headers.append(("x-ratelimit-reset-requests", format_duration(status.reset_requests_s or 0.0)))
    if status.limit_tokens is not None and status.remaining_tokens is not None:
        headers.append(("x-ratelimit-limit-tokens", str(status.limit_tokens)))
        headers.append(("x-ratelimit-remaining-tokens", str(status.remaining_tokens)))
        headers.append(("x-ratelimit-reset-tokens", format_duration(status.reset_tokens_s or 0.0)))
    return headers


def retry_headers(retry_after_s: float | None) -> list[Header]:
    """`retry-after` in whole seconds (at least 1) plus the exact `retry-after-ms`; no retry when None."""
    if retry_after_s is None:
        return [("x-should-retry", "false")]
    return [
        ("retry-after", str(max(1, math.ceil(retry_after_s)))),
        ("retry-after-ms", str(max(1, math.ceil(retry_after_s * 1000)))),
    ]


def _mutation(set_headers: Iterable[Header] = (), remove: Sequence[str] = ()) -> pb.HeaderMutation:
    return pb.HeaderMutation(
        set_headers=[
            base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=k, raw_value=v.encode("utf-8")))
            for k, v in set_headers
        ],
        remove_headers=list(remove),
    )


def immediate(
    status: int, body: bytes, headers: Iterable[Header] = (), details: str = ""
) -> pb.ProcessingResponse:
    """Answer the client directly; the request never reaches the upstream."""
    all_headers = [("content-type", "application/json"), *headers]
    return pb.ProcessingResponse(
        immediate_response=pb.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=status),
            headers=_mutation(all_headers),
            body=body,
            details=details,
        )
    )


def _common(
    set_headers: Iterable[Header] = (), remove: Sequence[str] = (), body: bytes | None = None
) -> pb.CommonResponse:
    common = pb.CommonResponse()
    headers = list(set_headers)
    if headers or remove:
        common.header_mutation.CopyFrom(_mutation(headers, remove))
    if body is not None:
        common.body_mutation.body = body
    return common


def continue_request_headers(passthrough: bool = False) -> pb.ProcessingResponse:
    response = pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=_common()))
    if passthrough:
        response.mode_override.CopyFrom(PASSTHROUGH_MODE)
    return response


def continue_request_body(
    set_headers: Iterable[Header] = (), remove: Sequence[str] = (), body: bytes | None = None
) -> pb.ProcessingResponse:
    return pb.ProcessingResponse(request_body=pb.BodyResponse(response=_common(set_headers, remove, body)))


def continue_response_headers(set_headers: Iterable[Header] = ()) -> pb.ProcessingResponse:
    return pb.ProcessingResponse(response_headers=pb.HeadersResponse(response=_common(set_headers)))


def continue_response_body(body: bytes | None = None) -> pb.ProcessingResponse:
    return pb.ProcessingResponse(response_body=pb.BodyResponse(response=_common(body=body)))


def continue_trailers(response: bool) -> pb.ProcessingResponse:
    if response:
        return pb.ProcessingResponse(response_trailers=pb.TrailersResponse())
    return pb.ProcessingResponse(request_trailers=pb.TrailersResponse())
