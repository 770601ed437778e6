"""The ext_proc servicer: protobuf in, the admission core's verdicts out, in either profile.

Envoy opens one `Process` stream per HTTP request. The servicer makes the request's `Exchange`
(extproc/admission/exchange.py) and hands the stream to the translator its profile implies: the inline one
(extproc/protocol/inline.py: request headers, body, response headers and STREAMED chunks) or the lean one
(extproc/protocol/lean.py: the request body alone). Nothing here decides anything, and nothing here names
a concrete admission or translator class it calls: the servicer depends on the two interfaces it declares,
`Admitting` (what it asks of admission, extproc/admission/compose.py `Admission`) and `Translator` (what it
asks of a profile's translator), as the EPP's handler depends on the `Director` it declares.

However the stream ends (end of response, client disconnect, upstream reset, Envoy's message timeout,
sidecar shutdown) the exchange is closed from the generator's `finally`, with a gRPC done-callback as a
backstop, and its lease settles exactly once. Envoy ends every RPC the same way, so how the RPC ended says
nothing about the response: the exchange decides completeness from the messages it saw. A reply to the
request body that the transport never took (the stream was reset first: Envoy's message timeout, or the
client gone) is reported to the exchange (`reply_undelivered`): an admission the proxy never received sent
nothing upstream.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any, Protocol

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from extproc.admission.exchange import Exchange
from extproc.admission.replies.verdicts import Refusal
from extproc.protocol.inline import InlineTranslator
from extproc.protocol.lean import LeanRuntime, LeanTranslator, is_lean
from extproc.protocol.messages import immediate

__all__ = ["ExtProcServicer"]

log = logging.getLogger(__name__)


class Admitting(Protocol):
    """What the servicer asks of admission: a new request's exchange, inline or `reported` (lean), and
    word of each stream that opens and closes (an open one is closed at shutdown, and the retry hints read
    the lease it holds)."""

    def exchange(self, reported: bool = False) -> Exchange: ...

    def opened(self, exchange: Exchange) -> None: ...

    def closed(self, exchange: Exchange) -> None: ...


class Translator(Protocol):
    """One stream in a profile's terms: each ext_proc message to the exchange's methods and its verdicts
    back to messages, the stream's next message (or a cut decided meanwhile), and the stream's end."""

    def handle(self, request: pb.ProcessingRequest) -> AsyncIterator[pb.ProcessingResponse]: ...

    async def next(
        self, messages: AsyncIterator[pb.ProcessingRequest]
    ) -> pb.ProcessingRequest | Refusal | None: ...

    def end(self, _context: Any = None) -> None: ...


class ExtProcServicer(pb_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    """Serves both profiles: each stream is translated by the profile its processing mode implies
    (`extproc.protocol.lean.is_lean`, read from the first message's `protocol_config`)."""

    def __init__(self, admission: Admitting, lean: LeanRuntime) -> None:
        self.admission = admission
        self.lean = lean

    def _translator(self, first: pb.ProcessingRequest) -> tuple[Exchange, Translator]:
        """The request's exchange and its profile's translator, the profile read from the first message."""
        if is_lean(first):
            exchange = self.admission.exchange(reported=True)
            return exchange, LeanTranslator(exchange, self.lean)
        exchange = self.admission.exchange()
        return exchange, InlineTranslator(exchange)

    async def Process(
        self, request_iterator: AsyncIterator[pb.ProcessingRequest], context: Any
    ) -> AsyncIterator[pb.ProcessingResponse]:
        messages = aiter(request_iterator)
        request: pb.ProcessingRequest | Refusal | None = await anext(messages, None)
        if request is None:
            return
        exchange, stream = self._translator(request)
        self.admission.opened(exchange)
        context.add_done_callback(stream.end)
        try:
            while request is not None:
                if isinstance(request, Refusal):  # decided while the response streams: reset it
                    yield immediate(request)
                    break
                async for response in stream.handle(request):
                    delivered = False
                    try:
                        yield response
                        delivered = True
                    finally:
                        if not delivered and request.WhichOneof("request") == "request_body":
                            # Reset before the transport took the verdict: the proxy never had it.
                            exchange.reply_undelivered()
                if exchange.finished:
                    break
                request = await stream.next(messages)
        finally:
            self.admission.closed(exchange)
            stream.end()
