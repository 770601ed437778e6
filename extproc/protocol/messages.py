"""Protobuf helpers both ext_proc translators share (inline: extproc/protocol/inline.py, lean:
extproc/protocol/lean.py): header values as Envoy 1.40 sends them, verdicts as replies, the request line
and claims Envoy delivers. Nothing here decides anything."""

from __future__ import annotations

import logging
from collections.abc import Iterable

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3 import http_status_pb2
from google.protobuf.duration_pb2 import Duration

from extproc.admission.exchange import Exchange, RequestHead
from extproc.admission.intake.rules import TenantSource
from extproc.admission.replies.verdicts import Forward, Header, Hold, Passthrough, Refusal
from extproc.admission.vocabulary.names import (
    CLIENT_ADDRESS_ATTRIBUTE,
    REQUEST_ID_HEADER,
    RESPONSE_FLAGS_ATTRIBUTE,
)

log = logging.getLogger(__name__)

EXT_PROC_ATTRIBUTES = "envoy.filters.http.ext_proc"
"""Key of the attributes Envoy sends (`request_attributes`) in `ProcessingRequest.attributes`."""

_MODE = processing_mode_pb2.ProcessingMode
PASSTHROUGH_MODE = _MODE(
    request_body_mode=_MODE.NONE,
    response_header_mode=_MODE.SKIP,
    response_body_mode=_MODE.NONE,
    request_trailer_mode=_MODE.SKIP,
    response_trailer_mode=_MODE.SKIP,
)
"""Mode override for requests that are not metered here (e.g. GET /v1/models): no further messages."""


def header_values(message: pb.HttpHeaders) -> dict[str, str]:
    """Header values as Envoy 1.40 sends them (`raw_value`; `value` on older proxies), keys lowercased."""
    out: dict[str, str] = {}
    for h in message.headers.headers:
        raw = h.raw_value  # each field read costs a upb lookup: once per header
        out[h.key.lower()] = raw.decode("utf-8", "replace") if raw else h.value
    return out


def mutation(set_headers: Iterable[Header] = (), remove: Iterable[str] = ()) -> pb.HeaderMutation:
    """Header values go in `raw_value`: Envoy 1.40 rejects a header that sets both `value` and `raw_value`."""
    return pb.HeaderMutation(
        set_headers=[
            base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=k, raw_value=v.encode("utf-8")))
            for k, v in set_headers
        ],
        remove_headers=list(remove),
    )


def common_response(forward: Forward) -> pb.CommonResponse:
    common = pb.CommonResponse()
    if forward.set_headers or forward.remove_headers:
        common.header_mutation.CopyFrom(mutation(forward.set_headers, forward.remove_headers))
    if forward.body is not None:
        common.body_mutation.body = forward.body
    return common


def immediate(refusal: Refusal) -> pb.ProcessingResponse:
    """Answer the client directly; the request never reaches (or stops reaching) the upstream."""
    return pb.ProcessingResponse(
        immediate_response=pb.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=refusal.status),
            headers=mutation(refusal.all_headers),
            body=refusal.body,
            details=refusal.details,
        )
    )


def request_headers_reply(verdict: Forward | Passthrough | Refusal) -> pb.ProcessingResponse:
    if isinstance(verdict, Refusal):
        return immediate(verdict)
    if isinstance(verdict, Passthrough):
        response = pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=pb.CommonResponse()))
        response.mode_override.CopyFrom(PASSTHROUGH_MODE)
        return response
    return pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=common_response(verdict)))


def request_body_reply(verdict: Forward | Refusal | Hold) -> pb.ProcessingResponse:
    if isinstance(verdict, Refusal):
        return immediate(verdict)
    if isinstance(verdict, Hold):
        return pb.ProcessingResponse(override_message_timeout=Duration(seconds=verdict.seconds))
    return pb.ProcessingResponse(request_body=pb.BodyResponse(response=common_response(verdict)))


def response_body_reply(verdict: Forward | Refusal) -> pb.ProcessingResponse:
    if isinstance(verdict, Refusal):
        return immediate(verdict)
    return pb.ProcessingResponse(response_body=pb.BodyResponse(response=common_response(verdict)))


def tenant_claim(request: pb.ProcessingRequest, headers: dict[str, str], source: TenantSource) -> str | None:
    """The tenant from the configured trusted source: dynamic metadata set by an earlier filter, or a header
    that the proxy strips from clients and sets from verified identity (docs/tenants.md)."""
    if source.metadata_namespace:
        found = metadata_tenant(request, source)
        if found is not None:
            return found
    if source.header:
        return headers.get(source.header)
    return None


def metadata_tenant(request: pb.ProcessingRequest, source: TenantSource) -> str | None:
    """The tenant an earlier filter wrote to dynamic metadata (`admission.tenant.metadata`), if any."""
    namespace = request.metadata_context.filter_metadata.get(source.metadata_namespace or "")
    if namespace is None:
        return None
    value = namespace.fields.get(source.metadata_key)
    if value is not None and value.WhichOneof("kind") == "string_value":
        return str(value.string_value)
    return None


def client_address(request: pb.ProcessingRequest) -> str | None:
    """The downstream address, when Envoy sends the `source.address` attribute (`request_attributes`).

    Only the host is kept: a client that opens many connections is still one client.
    """
    attributes = request.attributes.get(EXT_PROC_ATTRIBUTES)
    if attributes is None:
        return None
    value = attributes.fields.get(CLIENT_ADDRESS_ATTRIBUTE)
    if value is None or value.WhichOneof("kind") != "string_value":
        return None
    host, sep, port = value.string_value.rpartition(":")
    return (host if sep and port.isdigit() else value.string_value).strip("[]") or None


NO_HEALTHY_UPSTREAM = 0x2
UPSTREAM_REMOTE_RESET = 0x10
UPSTREAM_CONNECTION_FAILURE = 0x20
UPSTREAM_CONNECTION_TERMINATION = 0x40
"""Envoy's response flags UH, UR, UF and UC as the `response.flags` attribute carries them: one bit per flag,
in the order of `StreamInfo::CoreResponseFlag` (envoy/stream_info/stream_info.h: NoHealthyUpstream is 1,
UpstreamRemoteReset 4, UpstreamConnectionFailure 5, UpstreamConnectionTermination 6). Envoy 1.40 sends 32800
(UF | URX, 0x8020) for a 503 after the retries of a refused connection (tests/e2e/test_engine_down_e2e.py)."""


def _response_flags(request: pb.ProcessingRequest) -> int:
    """The `response.flags` attribute (`response_attributes` in the inline profile's ext_proc filter), 0
    where it is missing."""
    attributes = request.attributes.get(EXT_PROC_ATTRIBUTES)
    if attributes is None:
        return 0
    value = attributes.fields.get(RESPONSE_FLAGS_ATTRIBUTE)
    if value is None or value.WhichOneof("kind") != "number_value":
        return 0
    return int(value.number_value)


def engine_unreachable(request: pb.ProcessingRequest) -> bool:
    """Whether Envoy says (its response flags) that it answered because it could not connect to any
    engine: UF or UH."""
    return bool(_response_flags(request) & (UPSTREAM_CONNECTION_FAILURE | NO_HEALTHY_UPSTREAM))


def upstream_reset(request: pb.ProcessingRequest) -> bool:
    """Whether Envoy says (its response flags) that the engine's connection was reset or closed after the
    request went to it: UR or UC (an engine stopping, or closing a kept-alive connection as the request
    came)."""
    return bool(_response_flags(request) & (UPSTREAM_REMOTE_RESET | UPSTREAM_CONNECTION_TERMINATION))


def on_request_headers(exchange: Exchange, request: pb.ProcessingRequest) -> pb.ProcessingResponse:
    """The request line and headers to the exchange, its verdict to a reply."""
    message = request.request_headers
    if request.HasField("protocol_config"):
        _check_body_mode(request.protocol_config.request_body_mode)
    headers = header_values(message)
    source = exchange.tenant_source()
    head = RequestHead(
        method=headers.get(":method", ""),
        path=headers.get(":path", ""),
        headers=headers,
        tenant=tenant_claim(request, headers, source),
        end_of_stream=message.end_of_stream,
        client=client_address(request),
        request_id=headers.get(REQUEST_ID_HEADER),
    )
    return request_headers_reply(exchange.request_headers(head))


_warned_body_mode = False


def _check_body_mode(mode: int) -> None:
    """Admission needs the whole body before anything goes upstream: say so once if Envoy streams it."""
    global _warned_body_mode
    if mode != _MODE.BUFFERED and not _warned_body_mode:
        _warned_body_mode = True
        log.error(
            "Envoy's request_body_mode is not BUFFERED: bodies reach the sidecar in pieces and requests "
            "are refused; set processing_mode.request_body_mode: BUFFERED",
            extra={"request_body_mode": _MODE.BodySendMode.Name(mode)},
        )
