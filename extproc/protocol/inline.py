"""The inline profile's translator: each ext_proc message of one stream to a call on its `Exchange`, each
verdict to one reply.

Envoy sends request headers, the BUFFERED request body, response headers and STREAMED response body chunks
(envoy/envoy.yaml's processing mode). Nothing here decides anything: the exchange does, and
extproc/protocol/messages.py builds the replies.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc.admission.exchange import Exchange
from extproc.admission.replies.verdicts import Refusal
from extproc.admission.vocabulary.names import UPSTREAM_SERVICE_TIME
from extproc.protocol.messages import (
    common_response,
    engine_unreachable,
    header_values,
    immediate,
    on_request_headers,
    request_body_reply,
    response_body_reply,
    upstream_reset,
)

__all__ = ["InlineTranslator"]


class InlineTranslator:
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
                engine_unreachable=engine_unreachable(request),
                upstream_reset=upstream_reset(request),
            )
            if isinstance(verdict, Refusal):  # the engine's refusal or its outage, answered in its place
                yield immediate(verdict)
            else:
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
