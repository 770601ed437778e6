"""The ext_proc translator of the lean profile: the request body in, the admission decision out.

In the lean profile Envoy sends the sidecar one message per request: the BUFFERED request body, with the
request's method, path, client address and tenant as attributes (`request_attributes`), its route having
already done path routing and the body cap (envoy/envoy-lean.yaml, rendered by extproc/lean/render.py).
Requests without a `content-length` (an HTTP/2 body of unknown length, a chunked upload) take a route that
also sends the request headers, so a request with no body at all still reaches the sidecar and is refused.

The response never reaches the sidecar. An admitted request's reply carries dynamic metadata (namespace
`extproc`): the key its end report will name, a reading spec for Envoy's Lua filter (how this API marks
content, usage and the end, see extproc/admission/reading.py), the `x-ratelimit-*` headers Envoy adds to the
response, and the backend priority header Envoy adds to the upstream request. When the HTTP request ends,
Envoy's gRPC access log brings the Lua filter's findings back (extproc/accesslog.py), and the exchange
settles from them.

The ext_proc stream itself stays open until the HTTP request ends (Envoy 1.40 keeps it open even with
every response phase off), which serves twice: its end starts the bounded wait for the end report, after
which the lease settles as `expired` (`admission.end_report_wait_seconds`), and while it is open the sidecar
can still answer on it. Where the report channel is known lost (`ReportChannel`: Envoy's access-log stream
closed with none left open, or several ended requests in a row got no report), waiting is pointless: a lease
settles as `expired` the moment its request ends, so its slot is free when the request is.

A class cut under KV pressure is reset through the open stream: an ImmediateResponse sent on the
open stream makes Envoy reset the HTTP stream, client and backend alike (a tick checks the pools' KV usage
every `TICK_SECONDS`; there is no per-chunk check in this profile).

The profile is chosen by the Envoy config, not by the sidecar: a stream whose processing mode sends no
response body (`protocol_config.response_body_mode` other than STREAMED) is translated here.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import struct_pb2
from google.protobuf.duration_pb2 import Duration

from extproc.admission.exchange import Exchange, Phase, RequestHead
from extproc.admission.headers import ratelimit_headers
from extproc.admission.names import (
    FORWARDED_REQUEST_HEADERS,
    NAMESPACE,
    RATELIMIT_HEADERS,
    READ_SPEC_KEY,
    REPORT_KEY,
    RESPONSE_NAMESPACE,
    tenant_attribute,
)
from extproc.admission.reading import ReadSpec
from extproc.admission.service import AdmissionService
from extproc.admission.verdicts import Forward, Hold, Passthrough, Refusal
from extproc.config import Config
from extproc.wire import (
    EXT_PROC_ATTRIBUTES,
    client_address,
    common_response,
    immediate,
    metadata_tenant,
    on_request_headers,
)

__all__ = [
    "NAMESPACE",
    "RATELIMIT_HEADERS",
    "REPORT_KEY",
    "RESPONSE_NAMESPACE",
    "LeanRuntime",
    "LeanTranslator",
    "is_lean",
    "tenant_attribute",
]

log = logging.getLogger(__name__)

TICK_SECONDS = 0.2
"""How often open lean requests are checked: the KV budget's estimate of their progress, and cuts."""

WARN_EVERY_SECONDS = 60.0
"""At most one warning per minute about leases expiring for want of their end report."""

MISSES_FOR_LOSS = 3
"""Ended requests in a row whose end report never came before the channel counts as lost. One miss can be a
report dropped in a reconnect; three in a row, with none arriving in between, is a broken path."""

_MODE = processing_mode_pb2.ProcessingMode


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


def lean_tenant_claim(request: pb.ProcessingRequest, config: Config) -> str | None:
    """The tenant from the trusted source: an earlier filter's dynamic metadata, else the trusted header,
    which Envoy sends as an attribute in this profile (the proxy strips it from clients, docs/tenants.md)."""
    source = config.admission.tenant
    if source.metadata_namespace:
        found = metadata_tenant(request, config)
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


class ChannelState(enum.Enum):
    """What the sidecar knows of Envoy's end-report channel (its gRPC access log)."""

    UP = "up"  # reports arrive, or nothing says they do not (a fresh sidecar: Envoy opens it on first use)
    LOST = "lost"  # no access-log stream is open, or requests keep ending without a report


class ReportChannel:
    """Whether Envoy's end reports reach the sidecar, from two signals only the sidecar has: the access-log
    streams open to it (Envoy keeps one per worker for good, so the last one closing means Envoy went away or
    the path to the sidecar broke) and the ended requests whose report never came. Any report, or a new
    access-log stream, proves the channel again. Shown as `extproc_end_report_channel_up`, counted in
    `extproc_end_report_channel_losses_total{cause}`, and logged on each change."""

    def __init__(self, service: AdmissionService, on_lost: Callable[[], None]) -> None:
        self.service = service
        self.state = ChannelState.UP
        self.streams = 0
        self._misses = 0
        self._on_lost = on_lost

    @property
    def lost(self) -> bool:
        return self.state is ChannelState.LOST

    def stream_opened(self) -> None:
        self.streams += 1
        self._restore("access-log stream opened")

    def stream_closed(self, closing: bool = False) -> None:
        """An access-log stream ended; with none left open (and the sidecar not shutting down) the reports of
        requests ending now have no way in."""
        self.streams = max(0, self.streams - 1)
        if self.streams == 0 and not closing:
            self._lose("stream_closed")

    def reported(self) -> None:
        """An access-log entry arrived (whichever lease it names): the channel works."""
        self._misses = 0
        self._restore("end report received")

    def missed(self) -> None:
        """A request's report did not come within the bounded wait."""
        self._misses += 1
        if self._misses >= MISSES_FOR_LOSS:
            self._lose("misses")

    def _lose(self, cause: str) -> None:
        if self.lost:
            return
        self.state = ChannelState.LOST
        metrics = self.service.metrics
        metrics.end_report_channel.set(0)
        self.service.child(metrics.end_report_channel_losses, cause).inc()
        log.warning(
            "end-report channel down: leases are released when their request ends and charged by the "
            "decode-rate estimate (is Envoy's access log reaching the sidecar's gRPC port?)",
            extra={"cause": cause, "misses": self._misses, "access_log_streams": self.streams},
        )
        self._on_lost()

    def _restore(self, why: str) -> None:
        if not self.lost:
            return
        self.state = ChannelState.UP
        self._misses = 0
        self.service.metrics.end_report_channel.set(1)
        log.info("end-report channel restored", extra={"reason": why})


class LeanRuntime:
    """What the lean profile's streams share: the bounded wait for end reports, and the tick that follows
    the requests whose responses the sidecar does not see (KV-budget progress, cuts under KV pressure)."""

    def __init__(self, service: AdmissionService) -> None:
        self.service = service
        self.specs = _SpecCache()
        self._cuts: dict[Exchange, asyncio.Future[Refusal]] = {}
        self._task: asyncio.Task[None] | None = None
        self._warned_at: float | None = None
        self.channel = ReportChannel(service, self._expire_ended)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._tick_forever(), name="lean-tick")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def ended(self, exchange: Exchange) -> None:
        """The request's ext_proc stream closed, i.e. the HTTP request ended: wait for its end report at
        most `admission.end_report_wait_seconds`, then settle it as expired (at once: channel lost)."""
        exchange.mark_ended()
        if self.channel.lost:
            exchange.expire()
            return
        wait = self.service.config().admission.end_report_wait_seconds
        asyncio.get_running_loop().call_later(wait, self._expire, exchange, wait)

    def _expire_ended(self) -> None:
        """The channel was just found lost: the requests that ended and still wait will get no report."""
        for exchange in self.service.awaiting_reports():
            if exchange.ended_at is not None:
                exchange.expire()

    def _expire(self, exchange: Exchange, wait: float) -> None:
        """The bound passed: settle as expired, and say so (at most once a minute: a down access-log path
        expires every lease, and the metric counts them all)."""
        if not exchange.awaiting_report:
            return
        exchange.expire()
        self.channel.missed()
        now = asyncio.get_running_loop().time()
        if self._warned_at is None or now - self._warned_at >= WARN_EVERY_SECONDS:
            self._warned_at = now
            log.warning(
                "end report missing: lease expired (is Envoy's access log reaching the sidecar?)",
                extra={"wait_seconds": wait, "model": exchange.model_label},
            )

    async def cut_or_next(
        self, exchange: Exchange, messages: AsyncIterator[pb.ProcessingRequest]
    ) -> pb.ProcessingRequest | Refusal | None:
        """The stream's next message (None at its end), or a cut decided while the response streams. Only a
        request of a class that can be cut waits on both."""
        klass = exchange.klass
        if not exchange.awaiting_report or klass is None or klass.cut_streams_above_kv is None:
            return await anext(messages, None)
        cut: asyncio.Future[Refusal] = asyncio.get_running_loop().create_future()
        self._cuts[exchange] = cut
        following = asyncio.ensure_future(anext(messages, None))
        try:
            await asyncio.wait((following, cut), return_when=asyncio.FIRST_COMPLETED)
        finally:
            self._cuts.pop(exchange, None)
        if following.done():
            cut.cancel()
            return following.result()
        following.cancel()
        return cut.result()

    async def _tick_forever(self) -> None:
        while True:
            await asyncio.sleep(TICK_SECONDS)
            try:
                self.tick()
            except Exception:  # a bug here must not stop the tick for every later request
                log.exception("lean tick failed")

    def tick(self) -> None:
        """Follow every admitted request still running: grow its KV-budget footprint at the decode rate, and
        cut it when its class's watermark is passed."""
        pools: set[str] = set()
        for exchange in self.service.awaiting_reports():
            exchange.follow_unseen()
            if exchange.pool is not None and exchange.admitted is not None and exchange.admitted.budget:
                pools.add(exchange.pool)
            cut = self._cuts.get(exchange)
            if cut is not None and not cut.done():
                refusal = exchange.cut_unseen()
                if refusal is not None:
                    cut.set_result(refusal)
        for pool in pools:
            self.service.deps.budget_changed(pool)


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
        config = self.exchange.service.config()
        return RequestHead(
            method=_attribute(request, "request.method") or "",
            path=_attribute(request, "request.path") or "",
            headers={},
            tenant=lean_tenant_claim(request, config),
            client=client_address(request),
        )

    def _admitted(self, forward: Forward) -> pb.ProcessingResponse:
        reply = pb.ProcessingResponse(request_body=pb.BodyResponse(response=common_response(forward)))
        exchange = self.exchange
        admitted = exchange.admitted
        if admitted is None or exchange.phase is not Phase.ADMITTED:
            return reply  # shadow mode, or a request that ended while it waited: nothing to report
        key, spec = exchange.expect_report()
        fields = reply.dynamic_metadata.fields[NAMESPACE].struct_value.fields
        fields[REPORT_KEY].string_value = key
        fields[READ_SPEC_KEY].CopyFrom(self.runtime.specs.value(spec, admitted.strip_usage))
        for name, value in ratelimit_headers(admitted.lease.status):
            fields[name].string_value = value
        for name, value in forward.set_headers:
            if name in FORWARDED_REQUEST_HEADERS:
                fields[name].string_value = value
        return reply

    async def next(
        self, messages: AsyncIterator[pb.ProcessingRequest]
    ) -> pb.ProcessingRequest | Refusal | None:
        return await self.runtime.cut_or_next(self.exchange, messages)

    def end(self, _context: Any = None) -> None:
        """However the stream ended: an admitted request waits for its report, anything else closes."""
        if self._ended:
            return
        self._ended = True
        if self.exchange.awaiting_report:
            self.runtime.ended(self.exchange)
        else:
            self.exchange.close()
