"""The lean profile's end signal: Envoy's gRPC access log service, one entry per finished metered request.

Envoy streams access-log entries (`envoy.access_loggers.http_grpc`, HttpGrpcAccessLogConfig) to this
`AccessLogService` on the sidecar's gRPC port, in batches flushed every `buffer_flush_interval`. An access-log
filter logs only requests the sidecar admitted in this profile (their dynamic metadata carries the report
key, extproc/admission/vocabulary/names.py), so each entry names one waiting lease. What the entry carries
(fields of envoy.data.accesslog.v3.HTTPAccessLogEntry, data-plane-api @ 84e84367):

* `common_properties.metadata.filter_metadata`: `extproc` (the report key the sidecar set) and
  `extproc.response` (what the Lua response reader saw, extproc/envoyconf/response.lua);
* `response.response_code`: the status sent to the client, 0 when no response started;
* `common_properties.start_time` and `time_to_last_upstream_rx_byte` (offset from it; `duration`, the
  stream's end, where the upstream's answer never ended), with the Lua
  reader's `t1` (the first content event, on Envoy's same wall clock): the first-token delay and the decode
  time of a streamed answer, from which the pool's decode pace is learned for the KV budget's forecast and
  for the charge of unseen answers (`time_to_first_upstream_rx_byte` stands in without `t1`);
* `request.request_id`: the request's `x-request-id`, read only from an entry without a report key whose
  ext_proc exchange failed (`EXT_PROC_FAILED_DETAILS`): the sidecar admitted it, perhaps, but Envoy never had
  the verdict, so its lease is refunded (extproc/admission/tracking/unseen.py);
* `response.response_code_details`: `via_upstream` when the engine sent the status, else why Envoy made
  it (a reset before the response, no healthy upstream...): an engine's 503 is its queue full and refunded
  in full (`engine_busy`), Envoy's own 503 is not;
* `common_properties.response_flags`: why a request ended early (downstream disconnect, upstream reset...),
  logged for diagnosis; settlement reads only `upstream_connection_failure` (UF) and `no_healthy_upstream`
  (UH): Envoy could not connect to any engine, so the request settles as `engine_unreachable`, refunded in
  full (extproc/admission/capacity/charging.py), not as a filter's `not_forwarded`.

Entries are dropped by Envoy while this service is unreachable: the lease then expires by the bounded
rule (extproc/admission/tracking/unseen.py). An entry without a report key is a refusal Envoy answered itself
(the logger also logs those, extproc/envoyconf/lean.py): it is counted in `extproc_requests_total` like the
sidecar's own. The streams opening and closing, and every entry, tell admission's `ReportChannel` whether
the channel works. An entry whose key another replica issued is relayed to it through the shared store
(extproc/protocol/relay.py); one whose key is unknown (settled already, or issued before a restart) is counted
and ignored.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any, Protocol

from envoy.data.accesslog.v3 import accesslog_pb2
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc
from google.protobuf import struct_pb2

from extproc.admission.tracking.reading import ReportedTiming, ResponseReading
from extproc.admission.tracking.unseen import UnseenStreams
from extproc.admission.vocabulary.names import (
    EXT_PROC_FAILED_DETAILS,
    NAMESPACE,
    REPORT_KEY,
    RESPONSE_NAMESPACE,
)
from extproc.admission.vocabulary.names import ResponseField as Field

log = logging.getLogger(__name__)


class Relay(Protocol):
    """What the end reports ask of the relay between replicas (extproc/protocol/relay.py `ReportRelay`)."""

    def forward(self, key: str, entry: accesslog_pb2.HTTPAccessLogEntry) -> bool:
        """Hand an entry whose key this replica does not hold to the replica that issued it; False when
        the key names no other replica."""
        ...


def reading_of(found: struct_pb2.Struct | None) -> ResponseReading:
    """The Lua reader's fields (`ResponseField`, written by extproc/envoyconf/response.lua) as a
    `ResponseReading`."""
    if found is None:
        return ResponseReading()
    fields = found.fields

    def number(key: str) -> int:
        value = fields.get(key)
        return int(value.number_value) if value is not None else 0

    def number_or_none(key: str) -> float | None:
        value = fields.get(key)
        return float(value.number_value) if value is not None and value.HasField("number_value") else None

    def text(key: str) -> str | None:
        value = fields.get(key)
        return str(value.string_value) if value is not None and value.HasField("string_value") else None

    def flag(key: str) -> bool:
        value = fields.get(key)
        return bool(value is not None and value.bool_value)

    return ResponseReading(
        events=number(Field.EVENTS),
        events_at_usage=number(Field.EVENTS_AT_USAGE),
        usage_first=text(Field.USAGE_FIRST),
        usage_last=text(Field.USAGE_LAST),
        final=flag(Field.FINAL),
        error=flag(Field.ERROR),
        body_end=flag(Field.BODY_END),
        body=text(Field.BODY),
        tail=text(Field.TAIL),
        first_content_ms=number_or_none(Field.FIRST_CONTENT_MS),
    )


def timing_of(entry: accesslog_pb2.HTTPAccessLogEntry, reading: ResponseReading) -> ReportedTiming | None:
    """When the answer's tokens came. With the reader's first-content time (Envoy's wall clock, as the
    entry's `start_time`): the first-token delay and the decode time up to the last upstream byte. Without
    it, the span from the first to the last upstream byte stands in for the decode time only: a streaming
    server sends its headers before queueing and prefill, so that span includes them. Either way, and
    without a first upstream byte too, the time to the last one (`upstream_s`): where Envoy read the
    upstream on after the client left, the engine ran the request until then. None without that time."""
    props = entry.common_properties
    if props.HasField("time_to_last_upstream_rx_byte"):
        last_s = props.time_to_last_upstream_rx_byte.ToTimedelta().total_seconds()
    elif props.HasField("duration"):
        # The upstream's answer never ended (reset at the lifetime bound, the client gone): the engine ran
        # until the stream's end, which `duration` (start to end of the stream) marks.
        last_s = props.duration.ToTimedelta().total_seconds()
    else:
        return None
    if reading.first_content_ms is not None and props.HasField("start_time"):
        start_ms = props.start_time.ToMilliseconds()
        first_s = (reading.first_content_ms - start_ms) / 1000.0
        if 0.0 <= first_s <= last_s:
            return ReportedTiming(first_token_after_s=first_s, decode_s=last_s - first_s, upstream_s=last_s)
    if not props.HasField("time_to_first_upstream_rx_byte"):
        return ReportedTiming(first_token_after_s=None, decode_s=None, upstream_s=last_s)
    first_byte_s = props.time_to_first_upstream_rx_byte.ToTimedelta().total_seconds()
    return ReportedTiming(first_token_after_s=None, decode_s=last_s - first_byte_s, upstream_s=last_s)


VIA_UPSTREAM = "via_upstream"
"""Envoy's response code details of a status the upstream sent (StreamInfo::ResponseCodeDetails::ViaUpstream).
Any other value is a reply Envoy made itself: after the request went upstream, a reset before the response
(`upstream_reset_before_response_started{...}`, response flag UR/UC/UF) or a timeout (UT); before it, no
healthy upstream (UH) or the circuit breaker's overflow (UO), which also send no byte upstream. Only a 503
via the upstream is an engine's refusal (settlement.py, `engine_busy`)."""

ENVOY_REFUSAL_REASONS = {
    400: "invalid_request",
    404: "unknown_path",
    408: "request_timeout",
    413: "request_too_large",
    431: "request_header_fields_too_large",
}
"""The `reason` of each refusal Envoy answers itself (extproc/envoyconf/lean.py ENVOY_REFUSALS), named as the
sidecar names the same refusal (`unknown_path`, `request_too_large`) or as Envoy's reply words it (the `code`
of its local-reply mapper)."""


class EndReports(als_pb2_grpc.AccessLogServiceServicer):  # type: ignore[misc]
    """Settles each waiting lease from its access-log entry. With a shared store, an entry for a lease
    another replica holds is relayed to it (extproc/protocol/relay.py)."""

    def __init__(self, unseen: UnseenStreams) -> None:
        self.unseen = unseen
        self.service = unseen.service
        self.channel = unseen.channel
        self.relay: Relay | None = None
        self._streams: set[asyncio.Task[Any]] = set()
        self._closing = False

    async def StreamAccessLogs(
        self, request_iterator: AsyncIterator[als_pb2.StreamAccessLogsMessage], context: Any
    ) -> als_pb2.StreamAccessLogsResponse:
        task = asyncio.current_task()
        assert task is not None
        self._streams.add(task)
        self.channel.stream_opened()
        try:
            async for message in request_iterator:
                for entry in message.http_logs.log_entry:
                    self.settle(entry)
        except asyncio.CancelledError:
            if not self._closing:
                raise
        finally:
            self._streams.discard(task)
            self.channel.stream_closed(closing=self._closing)
        return als_pb2.StreamAccessLogsResponse()

    def count_refusal(self, entry: accesslog_pb2.HTTPAccessLogEntry) -> None:
        """An entry without a report key: a refusal Envoy answered itself (a direct 404, a 413 past its body
        bound, a 408, 431 or 400), counted where the sidecar counts its own refusals."""
        code = entry.response.response_code.value
        reason = ENVOY_REFUSAL_REASONS.get(code, "envoy_other")
        service = self.service
        service.child(service.metrics.end_reports, "envoy_refusal").inc()
        service.count("rejected", reason, "none", "none", None)
        log.info(
            "request refused by Envoy",
            extra={"status": code, "reason": reason, "details": entry.response.response_code_details[:100]},
        )

    def ext_proc_failed(self, entry: accesslog_pb2.HTTPAccessLogEntry) -> None:
        """An entry without a report key whose ext_proc exchange failed: Envoy's message timer fired before
        the sidecar's reply landed, so the key was never applied and, failing closed, Envoy answered the
        client itself (504) and sent nothing upstream. A lease admitted for it is found by the request's id
        when its wait ends (extproc/admission/tracking/unseen.py) and refunded in full. Not counted as a
        refusal: the sidecar counted its own decision."""
        service = self.service
        service.child(service.metrics.end_reports, "ext_proc_failed").inc()
        request_id = entry.request.request_id
        if request_id:
            self.unseen.unforwarded(request_id)
        response = entry.response
        log.info(
            "ext_proc exchange failed: not forwarded",
            extra={"status": response.response_code.value, "details": response.response_code_details[:100]},
        )

    def close(self) -> None:
        """Shutdown: end Envoy's streams (it keeps them open for good), so the server can stop early."""
        self._closing = True
        for task in list(self._streams):
            task.cancel()

    def settle(self, entry: accesslog_pb2.HTTPAccessLogEntry) -> None:
        self.channel.reported()
        metadata = entry.common_properties.metadata.filter_metadata
        admitted = metadata.get(NAMESPACE)
        key = admitted.fields.get(REPORT_KEY) if admitted is not None else None
        if key is None:
            if entry.response.response_code_details.startswith(EXT_PROC_FAILED_DETAILS):
                self.ext_proc_failed(entry)
            else:
                self.count_refusal(entry)
            return
        code = entry.response.response_code.value
        reading = reading_of(metadata.get(RESPONSE_NAMESPACE))
        # No byte sent upstream: a filter after the sidecar (an endpoint picker) answered the request locally.
        forwarded = entry.common_properties.HasField("time_to_first_upstream_tx_byte")
        engine_answered = entry.response.response_code_details == VIA_UPSTREAM
        flags = entry.common_properties.response_flags
        unreachable = flags.upstream_connection_failure or flags.no_healthy_upstream
        timing = timing_of(entry, reading)
        # Envoy's bytesSent (http_grpc_access_log_impl.cc): the body's bytes that passed its filters.
        passed_bytes = entry.response.response_body_bytes
        if not self.unseen.report(
            key.string_value,
            code or None,
            reading,
            timing,
            forwarded,
            engine_answered,
            passed_bytes,
            engine_unreachable=unreachable,
        ):
            relayed = self.relay is not None and self.relay.forward(key.string_value, entry)
            self.service.child(self.service.metrics.end_reports, "relayed" if relayed else "unknown").inc()
            return
        self.service.child(self.service.metrics.end_reports, "matched").inc()
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "end report",
                extra={
                    "status": code,
                    "details": entry.response.response_code_details,
                    "flags": str(entry.common_properties.response_flags).replace("\n", " "),
                },
            )
