"""The ext_proc translator of the lean profile: the request body in, the admission decision out.

In the lean profile Envoy sends the sidecar one message per request: the BUFFERED request body, with the
request's method, path, client address, tenant and the headers admission reads (a client's deadline, an
inference pool's objective and fairness id, the body's content type: `ATTRIBUTE_HEADERS`) as attributes
(`request_attributes`), its route having already done path routing and the body cap (envoy/envoy-lean.yaml,
rendered by extproc/envoyconf/lean.py).
Requests without a `content-length` (an HTTP/2 body of unknown length, a chunked upload) take a route that
also sends the request headers, so a request with no body at all still reaches the sidecar and is refused.

The response never reaches the sidecar. An admitted request's `Forward` verdict carries what the proxy
needs, and this translator writes it as dynamic metadata (namespace `extproc`, names in
extproc/admission/vocabulary/names.py) without deciding anything: the key its end report will name, a reading
spec for Envoy's Lua filter (how this API marks content, usage and the end, see
extproc/admission/tracking/reading.py), and name-value pairs the route turns into headers (`x-ratelimit-*` on
the response, the backend priority on the upstream request). When the HTTP request ends, Envoy's gRPC access
log brings the Lua filter's findings back (extproc/protocol/accesslog.py), and admission settles the request
from them.

The ext_proc stream itself stays open until the HTTP request ends (Envoy 1.40 keeps it open even with
every response phase off), which serves twice: its end starts the bounded wait for the end report, after
which the lease settles as `expired` (`admission.end_report_wait_seconds`), and while it is open the sidecar
can still answer on it: a cut under KV pressure, decided by admission's tick
(extproc/admission/tracking/unseen.py), goes out as an ImmediateResponse, which makes Envoy reset the HTTP
stream, client and backend alike.

The profile is chosen by the Envoy config, not by the sidecar: a stream whose processing mode sends no
response body (`protocol_config.response_body_mode` other than STREAMED) is translated here.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import struct_pb2
from google.protobuf.duration_pb2 import Duration

from extproc.admission.exchange import Exchange, RequestHead
from extproc.admission.intake.rules import TenantSource
from extproc.admission.replies.verdicts import Forward, Hold, Passthrough, Refusal
from extproc.admission.tracking.reading import ReadSpec
from extproc.admission.tracking.unseen import UnseenStreams
from extproc.admission.vocabulary.names import (
    ATTRIBUTE_HEADERS,
    METHOD_ATTRIBUTE,
    NAMESPACE,
    PATH_ATTRIBUTE,
    READ_SPEC_KEY,
    REPORT_KEY,
    REQUEST_ID_ATTRIBUTE,
    header_attribute,
    tenant_attribute,
)
from extproc.protocol.messages import (
    EXT_PROC_ATTRIBUTES,
    client_address,
    common_response,
    immediate,
    metadata_tenant,
    on_request_headers,
)

__all__ = ["LeanRuntime", "LeanTranslator", "is_lean"]

log = logging.getLogger(__name__)

_MODE = processing_mode_pb2.ProcessingMode

_HEADER_ATTRIBUTES = tuple((name, header_attribute(name)) for name in ATTRIBUTE_HEADERS)
"""Each header admission reads from the attributes, and the attribute that carries it: named once, not per
request."""


def is_lean(request: pb.ProcessingRequest) -> bool:
    """A stream whose processing mode sends the sidecar no response body (sent with its first message)."""
    if not request.HasField("protocol_config"):
        return False
    return bool(request.protocol_config.response_body_mode != _MODE.STREAMED)


def _attribute(request: pb.ProcessingRequest, name: str) -> str | None:
    attributes = request.attributes.get(EXT_PROC_ATTRIBUTES)
    if attributes is None:
        return None
    value = attributes.fields.get(name)
    if value is None or value.WhichOneof("kind") != "string_value":
        return None
    return str(value.string_value)


def lean_tenant_claim(request: pb.ProcessingRequest, source: TenantSource) -> str | None:
    """The tenant from the trusted source: an earlier filter's dynamic metadata, else the trusted header,
    which Envoy sends as an attribute in this profile (the proxy strips it from clients, docs/tenants.md)."""
    if source.metadata_namespace:
        found = metadata_tenant(request, source)
        if found is not None:
            return found
    if source.header:
        return _attribute(request, tenant_attribute(source.header))
    return None


class _SpecCache:
    """Reading specs as protobuf values, built once per (spec, strip): a copy is cheaper than a build."""

    def __init__(self) -> None:
        self._values: dict[tuple[int, bool], struct_pb2.Value] = {}

    def value(self, spec: ReadSpec, strip: bool) -> struct_pb2.Value:
        key = (id(spec), strip)
        found = self._values.get(key)
        if found is None:
            found = struct_pb2.Value()
            found.struct_value.update(spec.to_struct(strip))
            self._values[key] = found
        return found


class LeanRuntime:
    """What the lean profile's streams share: the reading specs as protobuf values, and admission's
    bookkeeping of the requests whose answers the sidecar does not see
    (extproc/admission/tracking/unseen.py)."""

    def __init__(self, unseen: UnseenStreams) -> None:
        self.unseen = unseen
        self.specs = _SpecCache()

    def start(self) -> None:
        self.unseen.start()

    async def stop(self) -> None:
        await self.unseen.stop()


class LeanTranslator:
    """One ext_proc stream of the lean profile (see the module docstring)."""

    def __init__(self, exchange: Exchange, runtime: LeanRuntime) -> None:
        self.exchange = exchange
        self.runtime = runtime
        self._headers_seen = False
        self._ended = False

    async def handle(self, request: pb.ProcessingRequest) -> AsyncIterator[pb.ProcessingResponse]:
        kind = request.WhichOneof("request")
        if kind == "request_body":
            async for reply in self._on_body(request):
                yield reply
        elif kind == "request_headers":
            # The route for requests without a content-length sends the headers too: as in the inline profile.
            self._headers_seen = True
            yield on_request_headers(self.exchange, request)
        elif kind == "request_trailers":
            yield pb.ProcessingResponse(request_trailers=pb.TrailersResponse())
        else:
            raise ValueError(f"unexpected ext_proc message {kind!r} in the lean profile")

    async def _on_body(self, request: pb.ProcessingRequest) -> AsyncIterator[pb.ProcessingResponse]:
        exchange = self.exchange
        if not self._headers_seen:
            verdict = exchange.request_headers(self._head(request))
            if isinstance(verdict, Refusal):
                yield immediate(verdict)
                return
            if isinstance(verdict, Passthrough):
                yield pb.ProcessingResponse(request_body=pb.BodyResponse())
                return
        async for step in exchange.request_body(request.request_body.body):
            if isinstance(step, Refusal):
                yield immediate(step)
            elif isinstance(step, Hold):
                yield pb.ProcessingResponse(override_message_timeout=Duration(seconds=step.seconds))
            else:
                yield self._admitted(step)

    def _head(self, request: pb.ProcessingRequest) -> RequestHead:
        """The request line from the attributes Envoy sends with the body (the routes already checked it)."""
        source = self.exchange.tenant_source()
        headers = {
            name: value
            for name, attribute in _HEADER_ATTRIBUTES
            if (value := _attribute(request, attribute)) is not None
        }
        return RequestHead(
            method=_attribute(request, METHOD_ATTRIBUTE) or "",
            path=_attribute(request, PATH_ATTRIBUTE) or "",
            headers=headers,
            tenant=lean_tenant_claim(request, source),
            client=client_address(request),
            request_id=_attribute(request, REQUEST_ID_ATTRIBUTE),
        )

    def _admitted(self, forward: Forward) -> pb.ProcessingResponse:
        """The admitting reply; where the end will be reported, the metadata the proxy reads it by."""
        reply = pb.ProcessingResponse(request_body=pb.BodyResponse(response=common_response(forward)))
        ticket = forward.report
        if ticket is None:
            return reply  # shadow mode, or a request that ended while it waited: nothing to report
        fields = reply.dynamic_metadata.fields[NAMESPACE].struct_value.fields
        fields[REPORT_KEY].string_value = ticket.key
        fields[READ_SPEC_KEY].CopyFrom(self.runtime.specs.value(ticket.spec, ticket.strip_usage))
        for name, value in forward.metadata:
            fields[name].string_value = value
        return reply

    async def next(
        self, messages: AsyncIterator[pb.ProcessingRequest]
    ) -> pb.ProcessingRequest | Refusal | None:
        """The stream's next message, or the cut admission decides while the response streams."""
        return await self.exchange.next_or_cut(anext(messages, None))

    def end(self, _context: Any = None) -> None:
        """However the stream ended: an admitted request waits for its report, anything else settles."""
        if self._ended:
            return
        self._ended = True
        self.exchange.stream_ended()
