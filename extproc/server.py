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
from collections.abc import AsyncIterator
from typing import Any

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from extproc.admission.exchange import Exchange
from extproc.admission.names import UPSTREAM_SERVICE_TIME
from extproc.admission.service import AdmissionService
from extproc.admission.unseen import UnseenStreams
from extproc.admission.verdicts import Refusal
from extproc.server_lean import LeanRuntime, LeanTranslator, is_lean
from extproc.wire import (
    EXT_PROC_ATTRIBUTES,
    client_address,
    common_response,
    header_values,
    immediate,
    on_request_headers,
    request_body_reply,
    response_body_reply,
)

__all__ = ["EXT_PROC_ATTRIBUTES", "ExtProcServicer", "StreamTranslator", "client_address"]

log = logging.getLogger(__name__)


class StreamTranslator:
    """One ext_proc stream: translates each message to the exchange and each verdict to a reply."""

    def __init__(self, exchange: Exchange) -> None:
        self.exchange = exchange

    async def handle(self, request: pb.ProcessingRequest) -> AsyncIterator[pb.ProcessingResponse]:
        """The replies to one message: normally one; a waiting request first extends Envoy's timer."""
        kind = request.WhichOneof("request")
        exchange = self.exchange
        if kind == "request_headers":
            yield self.on_request_headers(request)
        elif kind == "request_body":
            async for verdict in exchange.request_body(request.request_body.body):
                yield request_body_reply(verdict)
        elif kind == "response_headers":
            headers = header_values(request.response_headers)
            status = headers.get(":status", "")
            verdict = exchange.response_headers(
                int(status) if status.isdigit() else None,
                headers.get("content-type", ""),
                request.response_headers.end_of_stream,
                from_router=UPSTREAM_SERVICE_TIME in headers,
            )
            yield pb.ProcessingResponse(
                response_headers=pb.HeadersResponse(response=common_response(verdict))
            )
        elif kind == "response_body":
            body = request.response_body
            yield response_body_reply(await exchange.response_body(body.body, body.end_of_stream))
        elif kind == "request_trailers":
            yield pb.ProcessingResponse(request_trailers=pb.TrailersResponse())
        elif kind == "response_trailers":
            exchange.response_trailers()
            yield pb.ProcessingResponse(response_trailers=pb.TrailersResponse())
        else:
            raise ValueError(f"unexpected ext_proc message {kind!r}")

    def on_request_headers(self, request: pb.ProcessingRequest) -> pb.ProcessingResponse:
        return on_request_headers(self.exchange, request)

    async def next(
        self, messages: AsyncIterator[pb.ProcessingRequest]
    ) -> pb.ProcessingRequest | Refusal | None:
        return await anext(messages, None)

    def end(self, _context: Any = None) -> None:
        """The stream ended, however it ended: the exchange settles from the messages it saw."""
        self.exchange.stream_ended()


class ExtProcServicer(pb_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    """Serves both profiles: each stream is translated by the profile its processing mode implies
    (`extproc.server_lean.is_lean`, read from the first message's `protocol_config`)."""

    def __init__(self, service: AdmissionService, lean: LeanRuntime | None = None) -> None:
        self.service = service
        self.lean = lean if lean is not None else LeanRuntime(UnseenStreams(service))

    async def Process(
        self, request_iterator: AsyncIterator[pb.ProcessingRequest], context: Any
    ) -> AsyncIterator[pb.ProcessingResponse]:
        messages = aiter(request_iterator)
        request: pb.ProcessingRequest | Refusal | None = await anext(messages, None)
        if request is None:
            return
        stream: StreamTranslator | LeanTranslator
        if is_lean(request):
            exchange = Exchange(self.service, self.lean.unseen)
            stream = LeanTranslator(exchange, self.lean)
        else:
            exchange = Exchange(self.service)
            stream = StreamTranslator(exchange)
        self.service.register(exchange)
        self.service.metrics.streams.inc()
        context.add_done_callback(stream.end)
        try:
            while request is not None:
                if isinstance(request, Refusal):  # decided while the response streams: reset it
                    yield immediate(request)
                    break
                async for response in stream.handle(request):
                    yield response
                if exchange.finished:
                    break
                request = await stream.next(messages)
        finally:
            self.service.unregister(exchange)
            self.service.metrics.streams.dec()
            stream.end()
