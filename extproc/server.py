"""The ext_proc servicer of the inline profile: protobuf in, the admission core's verdicts out.

Envoy opens one `Process` stream per HTTP request and sends request headers, the BUFFERED request body,
response headers and STREAMED response body chunks. Each message becomes one call on the request's
`Exchange` (extproc/admission/exchange.py), and each verdict one reply. Nothing here decides anything.

However the stream ends (end of response, client disconnect, upstream reset, Envoy's message timeout,
sidecar shutdown) the exchange is closed from the generator's `finally`, with a gRPC done-callback as a
backstop, and its lease settles exactly once. Envoy ends every RPC the same way, so how the RPC ended says
nothing about the response: the exchange decides completeness from the messages it saw.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterable
from typing import Any

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf.duration_pb2 import Duration

from extproc.admission.exchange import Exchange, RequestHead
from extproc.admission.service import AdmissionService
from extproc.admission.verdicts import Forward, Header, Hold, Passthrough, Refusal
from extproc.config import Config

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


def _headers(message: pb.HttpHeaders) -> dict[str, str]:
    """Header values as Envoy 1.40 sends them (`raw_value`; `value` on older proxies), keys lowercased."""
    out: dict[str, str] = {}
    for h in message.headers.headers:
        raw = h.raw_value if h.raw_value else h.value.encode("utf-8")
        out[h.key.lower()] = raw.decode("utf-8", "replace")
    return out


def _mutation(set_headers: Iterable[Header] = (), remove: Iterable[str] = ()) -> pb.HeaderMutation:
    """Header values go in `raw_value`: Envoy 1.40 rejects a header that sets both `value` and `raw_value`."""
    return pb.HeaderMutation(
        set_headers=[
            base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=k, raw_value=v.encode("utf-8")))
            for k, v in set_headers
        ],
        remove_headers=list(remove),
    )


def _common(forward: Forward) -> pb.CommonResponse:
    common = pb.CommonResponse()
    if forward.set_headers or forward.remove_headers:
        common.header_mutation.CopyFrom(_mutation(forward.set_headers, forward.remove_headers))
    if forward.body is not None:
        common.body_mutation.body = forward.body
    return common


def immediate(refusal: Refusal) -> pb.ProcessingResponse:
    """Answer the client directly; the request never reaches (or stops reaching) the upstream."""
    return pb.ProcessingResponse(
        immediate_response=pb.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=refusal.status),
            headers=_mutation(refusal.all_headers),
            body=refusal.body,
            details=refusal.details,
        )
    )


def _request_headers_reply(verdict: Forward | Passthrough | Refusal) -> pb.ProcessingResponse:
    if isinstance(verdict, Refusal):
        return immediate(verdict)
    if isinstance(verdict, Passthrough):
        response = pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=pb.CommonResponse()))
        response.mode_override.CopyFrom(PASSTHROUGH_MODE)
        return response
    return pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=_common(verdict)))


def _request_body_reply(verdict: Forward | Refusal | Hold) -> pb.ProcessingResponse:
    if isinstance(verdict, Refusal):
        return immediate(verdict)
    if isinstance(verdict, Hold):
        return pb.ProcessingResponse(override_message_timeout=Duration(seconds=verdict.seconds))
    return pb.ProcessingResponse(request_body=pb.BodyResponse(response=_common(verdict)))


def _response_body_reply(verdict: Forward | Refusal) -> pb.ProcessingResponse:
    if isinstance(verdict, Refusal):
        return immediate(verdict)
    return pb.ProcessingResponse(response_body=pb.BodyResponse(response=_common(verdict)))


def tenant_claim(request: pb.ProcessingRequest, headers: dict[str, str], config: Config) -> str | None:
    """The tenant from the configured trusted source: dynamic metadata set by an earlier filter, or a header
    that the proxy strips from clients and sets from verified identity (docs/tenants.md)."""
    source = config.admission.tenant
    if source.metadata_namespace:
        namespace = request.metadata_context.filter_metadata.get(source.metadata_namespace)
        if namespace is not None:
            value = namespace.fields.get(source.metadata_key)
            if value is not None and value.WhichOneof("kind") == "string_value":
                return str(value.string_value)
    if source.header:
        return headers.get(source.header)
    return None


def client_address(request: pb.ProcessingRequest) -> str | None:
    """The downstream address, when Envoy sends the `source.address` attribute (`request_attributes`).

    Only the host is kept: a client that opens many connections is still one client.
    """
    attributes = request.attributes.get(EXT_PROC_ATTRIBUTES)
    if attributes is None:
        return None
    value = attributes.fields.get("source.address")
    if value is None or value.WhichOneof("kind") != "string_value":
        return None
    host, sep, port = value.string_value.rpartition(":")
    return (host if sep and port.isdigit() else value.string_value).strip("[]") or None


class StreamTranslator:
    """One ext_proc stream: translates each message to the exchange and each verdict to a reply."""

    def __init__(self, exchange: Exchange) -> None:
        self.exchange = exchange

    async def handle(self, request: pb.ProcessingRequest) -> AsyncIterator[pb.ProcessingResponse]:
        """The replies to one message: normally one; a waiting request first extends Envoy's timer."""
        kind = request.WhichOneof("request")
        exchange = self.exchange
        if kind == "request_headers":
            yield self._on_request_headers(request)
        elif kind == "request_body":
            async for verdict in exchange.request_body(request.request_body.body):
                yield _request_body_reply(verdict)
        elif kind == "response_headers":
            headers = _headers(request.response_headers)
            status = headers.get(":status", "")
            verdict = exchange.response_headers(
                int(status) if status.isdigit() else None,
                headers.get("content-type", ""),
                request.response_headers.end_of_stream,
            )
            yield pb.ProcessingResponse(response_headers=pb.HeadersResponse(response=_common(verdict)))
        elif kind == "response_body":
            body = request.response_body
            yield _response_body_reply(await exchange.response_body(body.body, body.end_of_stream))
        elif kind == "request_trailers":
            yield pb.ProcessingResponse(request_trailers=pb.TrailersResponse())
        elif kind == "response_trailers":
            exchange.response_trailers()
            yield pb.ProcessingResponse(response_trailers=pb.TrailersResponse())
        else:
            raise ValueError(f"unexpected ext_proc message {kind!r}")

    def _on_request_headers(self, request: pb.ProcessingRequest) -> pb.ProcessingResponse:
        message = request.request_headers
        if request.HasField("protocol_config"):
            _check_body_mode(request.protocol_config.request_body_mode)
        headers = _headers(message)
        config = self.exchange.service.config()
        head = RequestHead(
            method=headers.get(":method", ""),
            path=headers.get(":path", ""),
            headers=headers,
            tenant=tenant_claim(request, headers, config),
            end_of_stream=message.end_of_stream,
            client=client_address(request),
        )
        return _request_headers_reply(self.exchange.request_headers(head))


class ExtProcServicer(pb_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    def __init__(self, service: AdmissionService) -> None:
        self.service = service

    async def Process(
        self, request_iterator: AsyncIterator[pb.ProcessingRequest], context: Any
    ) -> AsyncIterator[pb.ProcessingResponse]:
        exchange = Exchange(self.service)
        stream = StreamTranslator(exchange)
        self.service.register(exchange)
        self.service.metrics.streams.inc()
        context.add_done_callback(lambda _ctx: exchange.close())
        try:
            async for request in request_iterator:
                async for response in stream.handle(request):
                    yield response
                if exchange.finished:
                    break
        finally:
            self.service.unregister(exchange)
            self.service.metrics.streams.dec()
            exchange.close()


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
