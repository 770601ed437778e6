"""Every header and dynamic-metadata name the sidecar and its Envoy configs agree on, defined once.

The lean translator writes these names, the access log reads them back, and the Envoy renderer
(extproc/envoyconf/lean.py) writes the routes that copy them: a name changed here changes all three.
"""

from __future__ import annotations

NAMESPACE = "extproc"
"""Dynamic-metadata namespace the sidecar writes (ext_proc `metadata_options.receiving_namespaces`)."""

RESPONSE_NAMESPACE = "extproc.response"
"""Dynamic-metadata namespace the Lua filter writes and the access log brings back."""

REPORT_KEY = "id"
"""The report key in `NAMESPACE`; only requests that carry it are logged (the access log's filter)."""

READ_SPEC_KEY = "read"
"""The reading spec in `NAMESPACE`: how the Lua filter reads this API's answer (admission/readspec.py)."""

PRIORITY_HEADER = "x-vllm-priority"
"""The request header vLLM reads a request's scheduling priority from, on every API (the Messages API has no
body field for it)."""

FORWARDED_REQUEST_HEADERS = (PRIORITY_HEADER,)
"""Request headers the sidecar may set on an admitted request. Envoy skips the request headers in the lean
profile, so the sidecar passes them as metadata and the route adds them (`request_headers_to_add`)."""

RATELIMIT_HEADERS = (
    "x-ratelimit-limit-requests",
    "x-ratelimit-remaining-requests",
    "x-ratelimit-reset-requests",
    "x-ratelimit-limit-tokens",
    "x-ratelimit-remaining-tokens",
    "x-ratelimit-reset-tokens",
)
"""Response headers the lean route copies from the admission's metadata (`response_headers_to_add`)."""

UPSTREAM_SERVICE_TIME = "x-envoy-upstream-service-time"
"""Set by Envoy's router on every upstream response to a complete request, unless its
`suppress_envoy_headers` is on (envoy source/common/router/router.cc Filter::onUpstreamHeaders, v1.40): an
error response without it was made by a filter between the sidecar and the router, and never reached the
backend. Keep `suppress_envoy_headers` off (every shipped config does): behind such a router the backend's own
errors would be taken for local ones and their prompt refunded."""


def tenant_attribute(header: str) -> str:
    """The CEL attribute that gives the sidecar one request header without the header phase
    (`request.headers` is a map; Envoy 1.40 evaluates each `request_attributes` entry as an expression)."""
    return f"request.headers['{header}']"
