"""Every header, dynamic-metadata and request-attribute name the sidecar and its Envoy configs agree on,
defined once.

The lean translator writes these names, the access log reads them back, and the Envoy renderer
(extproc/envoyconf/lean.py) writes the routes that copy them: a name changed here changes all three. The Lua
response reader (extproc/envoyconf/response.lua) cannot import them and writes them again;
tests/unit/envoyconf/test_response_lua_names.py checks its copies.
"""

from __future__ import annotations

import enum

NAMESPACE = "extproc"
"""Dynamic-metadata namespace the sidecar writes (ext_proc `metadata_options.receiving_namespaces`)."""

RESPONSE_NAMESPACE = "extproc.response"
"""Dynamic-metadata namespace the Lua filter writes and the access log brings back."""


class ResponseField(enum.StrEnum):
    """The keys under `RESPONSE_NAMESPACE`: what the Lua response reader (extproc/envoyconf/response.lua)
    saw of an answer, read back from the access log (extproc/protocol/accesslog.py `reading_of`). One or two
    letters, as every access-log entry carries them; tests/unit/envoyconf/test_response_lua_names.py checks
    that the Lua writes exactly these."""

    EVENTS = "n"
    """Content events counted."""
    EVENTS_AT_USAGE = "m"
    """`EVENTS` when the last usage object was seen."""
    USAGE_FIRST = "u0"
    """The first usage object (its JSON text)."""
    USAGE_LAST = "u"
    """The last usage object (its JSON text)."""
    FINAL = "f"
    """A final event was seen."""
    ERROR = "e"
    """An error event was seen."""
    BODY_END = "x"
    """The body ended (end of stream)."""
    BODY = "b"
    """A JSON body, whole."""
    TAIL = "t"
    """The end of a JSON body too large to keep whole."""
    FIRST_CONTENT_MS = "t1"
    """When the first content event arrived, in ms since the epoch on Envoy's clock."""


REPORT_KEY = "id"
"""The report key in `NAMESPACE`; only requests that carry it are logged (the access log's filter)."""

READ_SPEC_KEY = "read"
"""The reading spec in `NAMESPACE`: how the Lua filter reads this API's answer
(admission/vocabulary/readspec.py)."""

PRIORITY_HEADER = "x-vllm-priority"
"""The request header vLLM reads a request's scheduling priority from, on every API (the Messages API has no
body field for it)."""

FORWARDED_REQUEST_HEADERS = (PRIORITY_HEADER,)
"""Request headers the sidecar may set on an admitted request. Envoy skips the request headers in the lean
profile, so the sidecar passes them as metadata and the route adds them (`request_headers_to_add`)."""

RATELIMIT_REQUEST_HEADERS = (
    "x-ratelimit-limit-requests",
    "x-ratelimit-remaining-requests",
    "x-ratelimit-reset-requests",
)
"""OpenAI's rate-limit headers for requests: the limit, what remains, when it resets (headers.py)."""

RATELIMIT_TOKEN_HEADERS = (
    "x-ratelimit-limit-tokens",
    "x-ratelimit-remaining-tokens",
    "x-ratelimit-reset-tokens",
)
"""The same three for tokens."""

RATELIMIT_HEADERS = (*RATELIMIT_REQUEST_HEADERS, *RATELIMIT_TOKEN_HEADERS)
"""Response headers the lean route copies from the admission's metadata (`response_headers_to_add`)."""

DETAILS_PREFIX = "extproc_"
"""How the response code details of every reply the sidecar answers itself begin (its ImmediateResponse's
`details`, admission/replies/refusals.py): Envoy's configs tell the sidecar's refusals from Envoy's own by it
(the lean access log's filter, extproc/envoyconf/lean.py `ENVOY_REFUSALS`, and the local-reply mappers, which
leave the sidecar's replies alone: envoy/envoy.yaml)."""

EXT_PROC_FAILED_DETAILS = "ext_proc_error"
"""How the response code details of a request whose ext_proc exchange failed begin (Envoy 1.40's ext_proc
filter; a message timeout reads `ext_proc_error_per-message_timeout_exceeded`, seen in the stdout access log
of envoy/envoy-lean.yaml). With the filter failing closed, Envoy answered such a request itself and sent
nothing upstream: the lean access log sends these to the sidecar (extproc/envoyconf/lean.py
`EXT_PROC_FAILURES`), which refunds the lease it may have admitted (extproc/protocol/accesslog.py)."""

UPSTREAM_SERVICE_TIME = "x-envoy-upstream-service-time"
"""Set by Envoy's router on every upstream response to a complete request, unless its
`suppress_envoy_headers` is on (envoy source/common/router/router.cc Filter::onUpstreamHeaders, v1.40): an
error response without it was made by a filter between the sidecar and the router, and never reached the
backend. Keep `suppress_envoy_headers` off (every shipped config does): behind such a router the backend's own
errors would be taken for local ones and their prompt refunded."""


CLIENT_ADDRESS_ATTRIBUTE = "source.address"
"""The ext_proc request attribute of the client's address (both profiles: the client's own limits)."""

RESPONSE_FLAGS_ATTRIBUTE = "response.flags"
"""The ext_proc response attribute of Envoy's response flags (inline profile, `response_attributes`): a reply
Envoy made because it could not connect to any engine carries UF or UH (extproc/protocol/messages.py)."""

METHOD_ATTRIBUTE = "request.method"
"""The ext_proc request attribute of the method: the lean profile skips the header phase."""

PATH_ATTRIBUTE = "request.path"
"""The ext_proc request attribute of the path (lean profile)."""

REQUEST_ID_ATTRIBUTE = "request.id"
"""The ext_proc request attribute of the request's `x-request-id` (lean profile). It never names a lease's
end report (`UnseenStreams.expect_report`: a client may send its own): it only finds the request Envoy
says it never forwarded, its ext_proc message having timed out (extproc/protocol/accesslog.py)."""

REQUEST_ID_HEADER = "x-request-id"
"""The same id as a request header, where the lean profile's headers route sends the headers."""

LEAN_REQUEST_ATTRIBUTES = (CLIENT_ADDRESS_ATTRIBUTE, METHOD_ATTRIBUTE, PATH_ATTRIBUTE, REQUEST_ID_ATTRIBUTE)
"""What the lean profile's ext_proc filter sends with the body (`request_attributes`), the tenant's header
(`tenant_attribute`) aside."""


def header_attribute(header: str) -> str:
    """The CEL attribute that gives the sidecar one request header without the header phase
    (`request.headers` is a map; Envoy 1.40 evaluates each `request_attributes` entry as an expression)."""
    return f"request.headers['{header}']"


def tenant_attribute(header: str) -> str:
    """The attribute of the trusted tenant header (`admission.tenant.header`)."""
    return header_attribute(header)


DEADLINE_HEADER = "x-extproc-ttft-deadline-ms"
"""A client's deadline for its first token, in milliseconds from when the sidecar sees the request
(extproc/admission/intake/deadline.py). This gateway's own name: a bad value is refused with a 400."""

LLMD_DEADLINE_HEADER = "x-llm-d-slo-ttft-ms"
"""llm-d's time-to-first-token objective in milliseconds from the request's arrival (llm-d/llm-d-router
pkg/epp/metadata/consts.go `TTFTSLOHeaderKey`, read by flowcontrol/ordering/slodeadline/slo_deadline.go
`calculateSLODeadline` @ ebab687): read the same way, a bad value ignored as llm-d ignores it."""

DEADLINE_HEADERS = (DEADLINE_HEADER, LLMD_DEADLINE_HEADER)
"""The request headers a deadline is read from; the tightest valid one holds."""

OBJECTIVE_HEADERS = ("x-llm-d-inference-objective", "x-gateway-inference-objective")
"""The inference objective of a request as an inference pool's endpoint picker reads it, current name
first, then the Gateway API Inference Extension's, which llm-d keeps as a deprecated alias (llm-d/llm-d-router
pkg/epp/metadata/consts.go `ObjectiveKey`, `OldObjectiveKey`, `GetLowerCaseHeaderValue` @ ebab687; the
Inference Extension's own picker read only the `x-gateway-` name from the request headers before the picker
moved to llm-d: kubernetes-sigs/gateway-api-inference-extension pkg/epp/metadata/consts.go and
pkg/epp/handlers/request.go @ 1748e829)."""

FAIRNESS_ID_HEADERS = ("x-llm-d-inference-fairness-id", "x-gateway-inference-fairness-id")
"""The flow-control fairness id, in the same order (`FlowFairnessIDKey`, `OldFlowFairnessIDKey`)."""

CONTENT_TYPE_HEADER = "content-type"
"""The request header an API's body format reads with the body (admission/vocabulary/body.py `BodyFormat`):
a multipart form's boundary is in it."""

DESTINATION_ENDPOINT_HEADER = "x-gateway-destination-endpoint"
"""The endpoint an inference pool's picker chose, `<ip:port>` or a list `<ip:port>,<ip:port>,...` whose first
is the primary (kubernetes-sigs/gateway-api-inference-extension docs/proposals/004-endpoint-picker-protocol,
protocol v1.0.0, "Destination Endpoint"). Read only where the sidecar runs after the picker and the operator
trusts it (`admission.inference_pool.trust_destination_endpoint`): then the request is booked on that
engine's KV budget (docs/gateways.md)."""

ATTRIBUTE_HEADERS = (
    *DEADLINE_HEADERS,
    *OBJECTIVE_HEADERS,
    *FAIRNESS_ID_HEADERS,
    CONTENT_TYPE_HEADER,
    DESTINATION_ENDPOINT_HEADER,
)
"""Request headers the lean profile's ext_proc filter sends as attributes (`header_attribute`) beside the
tenant's, so that admission reads them without the header phase."""
