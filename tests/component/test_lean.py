"""The lean profile's servicer over a real gRPC channel, as Envoy drives it: one request body with attributes,
dynamic metadata in the reply, then an access-log entry (or none) that settles the lease."""

from __future__ import annotations

import functools
import json
from collections.abc import AsyncIterator
from typing import Any, cast

import grpc
import pytest
from envoy.data.accesslog.v3 import accesslog_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import struct_pb2

from extproc.admission.tracking.reading import OPENAI_SPEC, ReportedTiming, ResponseReading
from extproc.admission.vocabulary.names import NAMESPACE, RATELIMIT_HEADERS, REPORT_KEY, RESPONSE_NAMESPACE
from extproc.admission.vocabulary.names import ResponseField as Field
from extproc.app import Sidecar
from extproc.protocol.accesslog import reading_of, timing_of
from extproc.protocol.lean import is_lean
from tests.support.servicer import BASE_CONFIG, Harness, chat, headers_msg, serving
from tests.support.waiting import eventually

_MODE = processing_mode_pb2.ProcessingMode
CONFIG: dict[str, Any] = {
    **BASE_CONFIG,
    "admission": {**BASE_CONFIG["admission"], "end_report_wait_seconds": 0.2},
}


def lean_body(
    body: bytes,
    path: str = "/v1/chat/completions",
    tenant: str | None = None,
    request_id: str | None = None,
) -> pb.ProcessingRequest:
    """The one message of a lean stream: the body, the attributes and the processing mode Envoy announces."""
    request = pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True))
    request.protocol_config.request_body_mode = _MODE.BUFFERED
    request.protocol_config.response_body_mode = _MODE.NONE
    attributes = request.attributes["envoy.filters.http.ext_proc"].fields
    attributes["request.method"].string_value = "POST"
    attributes["request.path"].string_value = path
    attributes["source.address"].string_value = "10.0.0.7:5555"
    if tenant is not None:
        attributes["request.headers['x-tenant']"].string_value = tenant
    if request_id is not None:
        attributes["request.id"].string_value = request_id
    return request


def entry(
    key: str, status: int, reading: dict[str, Any] | None, details: str = "via_upstream"
) -> accesslog_pb2.HTTPAccessLogEntry:
    log = accesslog_pb2.HTTPAccessLogEntry()
    metadata = log.common_properties.metadata.filter_metadata
    metadata[NAMESPACE].fields[REPORT_KEY].string_value = key
    if reading is not None:
        metadata[RESPONSE_NAMESPACE].CopyFrom(struct_pb2.Struct())
        metadata[RESPONSE_NAMESPACE].update(reading)
    log.response.response_code.value = status
    log.response.response_code_details = details  # "via_upstream": the status came from the engine
    # Envoy sets it once the request's first byte went upstream: every request here reached the backend.
    log.common_properties.time_to_first_upstream_tx_byte.FromMilliseconds(1)
    return log


class LeanHarness(Harness):
    def __init__(self, sidecar: Sidecar, channel: grpc.aio.Channel) -> None:
        super().__init__(sidecar, channel)
        self.channel = channel


@pytest.fixture
async def harness() -> AsyncIterator[Harness]:
    async with serving(CONFIG) as (sidecar, channel):
        yield LeanHarness(sidecar, channel)


async def report(harness: Harness, *entries: accesslog_pb2.HTTPAccessLogEntry) -> None:
    assert isinstance(harness, LeanHarness)
    stub = als_pb2_grpc.AccessLogServiceStub(harness.channel)
    call = stub.StreamAccessLogs()
    message = als_pb2.StreamAccessLogsMessage()
    message.http_logs.log_entry.extend(entries)
    await call.write(message)
    await call.done_writing()
    await call


class OpenReports:
    """An access-log stream kept open, as Envoy keeps its own: the report channel stays up throughout."""

    def __init__(self, harness: Harness) -> None:
        assert isinstance(harness, LeanHarness)
        self.call = als_pb2_grpc.AccessLogServiceStub(harness.channel).StreamAccessLogs()

    async def send(self, *entries: accesslog_pb2.HTTPAccessLogEntry) -> None:
        message = als_pb2.StreamAccessLogsMessage()
        message.http_logs.log_entry.extend(entries)
        await self.call.write(message)

    async def close(self) -> None:
        await self.call.done_writing()
        await self.call


def admitted_metadata(reply: pb.ProcessingResponse) -> dict[str, Any]:
    fields = reply.dynamic_metadata.fields[NAMESPACE].struct_value
    metadata: dict[str, Any] = json.loads(json.dumps({k: v for k, v in fields.items()}, default=_value))
    return metadata


def _value(v: Any) -> Any:
    from google.protobuf.json_format import MessageToDict

    return MessageToDict(v)


def test_a_stream_is_lean_when_its_mode_sends_no_response_body() -> None:
    assert is_lean(lean_body(b"{}"))
    assert not is_lean(pb.ProcessingRequest(request_body=pb.HttpBody(body=b"{}")))  # no protocol_config
    inline = lean_body(b"{}")
    inline.protocol_config.response_body_mode = _MODE.STREAMED
    assert not is_lean(inline)


async def test_admitted_body_carries_the_report_key_the_spec_and_the_headers(harness: Harness) -> None:
    s = harness.stream()
    reply = await s.send(lean_body(chat(max_tokens=40, stream=True)))
    assert reply.HasField("request_body")
    metadata = admitted_metadata(reply)
    assert metadata[REPORT_KEY]
    assert metadata["read"] == {**OPENAI_SPEC.to_struct(strip=True)}
    assert set(RATELIMIT_HEADERS) <= set(metadata)
    # include_usage injected: the body changed and the client's stream will have the usage event removed.
    assert b"include_usage" in reply.request_body.response.body_mutation.body
    assert harness.metric("extproc_active_requests") == 1
    await report(
        harness,
        entry(
            metadata[REPORT_KEY],
            200,
            {
                "n": 12.0,
                "m": 12.0,
                "f": True,
                "x": True,
                "u": json.dumps({"prompt_tokens": 9, "completion_tokens": 12}),
            },
        ),
    )
    await harness.settled()
    assert harness.metric("extproc_settlements_total", outcome="completed") == 1
    assert harness.metric("extproc_tokens_settled_total", kind="completion") == 12
    assert harness.metric("extproc_tokens_settled_total", kind="prompt") == 9
    assert harness.metric("extproc_end_reports_total", result="matched") == 1
    await s.close()


async def test_a_disconnect_charges_the_content_events_that_passed(harness: Harness) -> None:
    s = harness.stream()
    key = admitted_metadata(await s.send(lean_body(chat(max_tokens=40, stream=True))))[REPORT_KEY]
    s.cancel()
    await report(harness, entry(key, 200, {"n": 5.0}))
    await harness.settled()
    assert harness.metric("extproc_settlements_total", outcome="aborted") == 1
    # The five that passed, and the one the engine's step running at the abort generated.
    assert harness.metric("extproc_tokens_settled_total", kind="completion") == 5 + 1


async def test_an_unknown_or_repeated_report_settles_nothing(harness: Harness) -> None:
    s = harness.stream()
    key = admitted_metadata(await s.send(lean_body(chat())))[REPORT_KEY]
    await report(harness, entry("not-a-key", 200, None), entry(key, 500, None), entry(key, 200, None))
    await harness.settled()
    assert harness.metric("extproc_end_reports_total", result="matched") == 1
    assert harness.metric("extproc_end_reports_total", result="unknown") == 2
    assert harness.metric("extproc_settlements_total", outcome="upstream_error") == 1
    await s.close()


async def test_an_engine_503_is_refunded_in_full_and_envoys_own_is_not(harness: Harness) -> None:
    """The access log's response code details tell who made a 503: `via_upstream`, the engine (its queue
    full: nothing charged, counted apart); anything else, Envoy after the request went upstream (a reset
    before the response), which keeps the backend-error rule."""
    busy = '{"error":{"message":"The engine is currently busy","type":"Service Unavailable","code":503}}'
    s = harness.stream()
    key = admitted_metadata(await s.send(lean_body(chat(max_tokens=40))))[REPORT_KEY]
    await report(harness, entry(key, 503, {Field.BODY: busy, Field.BODY_END: True}))
    await s.close()
    await harness.settled()
    assert harness.metric("extproc_settlements_total", outcome="engine_busy") == 1
    assert harness.metric("extproc_engine_refusals_total", model="other", reason="queue_full") == 1
    reserved = harness.metric("extproc_tokens_reserved_total")
    assert reserved > 0 and harness.metric("extproc_tokens_refunded_total") == reserved

    s = harness.stream()
    key = admitted_metadata(await s.send(lean_body(chat(max_tokens=40))))[REPORT_KEY]
    reset = "upstream_reset_before_response_started{remote_reset}"
    await report(harness, entry(key, 503, None, details=reset))
    await s.close()
    await harness.settled()
    assert harness.metric("extproc_settlements_total", outcome="upstream_error") == 1
    assert harness.metric("extproc_engine_refusals_total", model="other", reason="queue_full") == 1


async def test_without_a_report_the_lease_expires_after_the_stream_ends(harness: Harness) -> None:
    s = harness.stream()
    await s.send(lean_body(chat(max_tokens=40)))
    assert harness.metric("extproc_active_requests") == 1  # the bound starts only when the stream ends
    await s.close()  # the HTTP request ended on Envoy; its report never comes
    await eventually(lambda: harness.metric("extproc_settlements_total", outcome="expired") == 1)
    await harness.settled()


def ext_proc_failed(request_id: str) -> accesslog_pb2.HTTPAccessLogEntry:
    """Envoy's entry for a request whose ext_proc message timed out: no report key (the admitting reply never
    landed), its own 504, and the request's id."""
    log = accesslog_pb2.HTTPAccessLogEntry()
    log.response.response_code.value = 504
    log.response.response_code_details = "ext_proc_error_per-message_timeout_exceeded"
    log.request.request_id = request_id
    return log


async def test_a_request_envoy_never_forwarded_is_refunded_and_owes_no_report(harness: Harness) -> None:
    """Envoy's message timer fired before the admission landed: it answered 504 itself, the report key was
    never applied, and its entry names only the request's id. Three such requests in a row are no sign of a
    lost report channel, and none is charged."""
    reports = OpenReports(harness)
    for n in range(3):
        s = harness.stream()
        reply = await s.send(lean_body(chat(max_tokens=40), request_id=f"req-{n}"))
        assert REPORT_KEY in admitted_metadata(reply)
        await reports.send(ext_proc_failed(f"req-{n}"))
        await s.close()
        await eventually(
            functools.partial(
                lambda want: harness.metric("extproc_settlements_total", outcome="not_forwarded") == want,
                n + 1,
            )
        )
    await harness.settled()
    assert harness.metric("extproc_end_report_channel_up") == 1
    await reports.close()
    assert harness.metric("extproc_settlements_total", outcome="expired") == 0
    assert harness.metric("extproc_end_reports_total", result="ext_proc_failed") == 3
    reserved = harness.metric("extproc_tokens_reserved_total")
    assert reserved > 0 and harness.metric("extproc_tokens_refunded_total") == reserved
    assert harness.metric("extproc_requests_total", decision="rejected") == 0


async def test_an_id_envoy_failed_does_not_refund_a_request_whose_report_comes(harness: Harness) -> None:
    """A client may send its own x-request-id: a request that did go upstream is settled by its own report,
    whatever another request with the same id did."""
    reports = OpenReports(harness)
    s = harness.stream()
    key = admitted_metadata(await s.send(lean_body(chat(max_tokens=40), request_id="shared")))[REPORT_KEY]
    await reports.send(ext_proc_failed("shared"))
    await s.close()
    usage = {"u": json.dumps({"prompt_tokens": 9, "completion_tokens": 30}), "f": True, "x": True}
    await reports.send(entry(key, 200, usage))
    await eventually(lambda: harness.metric("extproc_end_reports_total", result="matched") == 1)
    await harness.settled()
    await reports.close()
    assert harness.metric("extproc_settlements_total", outcome="completed") == 1
    assert harness.metric("extproc_settlements_total", outcome="not_forwarded") == 0


async def test_a_request_without_a_body_is_refused_on_the_headers_route(harness: Harness) -> None:
    s = harness.stream()
    message = headers_msg("POST", "/v1/chat/completions", eos=True)
    message.protocol_config.request_body_mode = _MODE.BUFFERED
    reply = await s.send(message)
    assert reply.immediate_response.status.code == 400
    s.cancel()


async def test_the_tenant_comes_from_its_attribute(harness: Harness) -> None:
    s = harness.stream()
    reply = await s.send(lean_body(chat(max_tokens=600), tenant="small"))
    # Tenant `small` has 600 tokens per minute: prompt + 600 cannot fit.
    assert reply.immediate_response.status.code == 429
    s.cancel()


def timed(log: accesslog_pb2.HTTPAccessLogEntry, first_byte_s: float, last_byte_s: float) -> None:
    """Envoy's timing of an entry: the request started at 1,700,000,000 s; upstream bytes at these offsets."""
    props = log.common_properties
    props.start_time.FromMilliseconds(1_700_000_000_000)
    props.time_to_first_upstream_rx_byte.FromMilliseconds(round(first_byte_s * 1000))
    props.time_to_last_upstream_rx_byte.FromMilliseconds(round(last_byte_s * 1000))


def approx_s(seconds: float) -> float:
    """pytest.approx in a float field: the dataclass's == compares the field with it, as with a float."""
    return cast(float, pytest.approx(seconds))


def test_the_report_times_the_first_token_from_the_readers_clock_and_envoys_start() -> None:
    log = entry("k", 200, None)
    timed(log, first_byte_s=0.05, last_byte_s=3.0)
    with_t1 = reading_of_fields({"t1": 1_700_000_000_000 + 1_000.0})
    assert timing_of(log, with_t1) == ReportedTiming(first_token_after_s=1.0, decode_s=2.0, upstream_s=3.0)
    # Without the reader's time: headers (sent before queueing and prefill) to the last byte, decode only.
    assert timing_of(log, ResponseReading(events=3)) == ReportedTiming(None, approx_s(2.95), 3.0)
    # A first-content time outside the request (another clock) is not trusted.
    wrong = reading_of_fields({"t1": 1_600_000_000_000.0})
    assert timing_of(log, wrong) == ReportedTiming(None, approx_s(2.95), 3.0)
    assert timing_of(entry("k", 200, None), with_t1) is None  # no upstream byte: nothing to learn
    # The upstream's answer never ended (the client gone, Envoy reset it): the stream's end bounds it.
    reset = entry("k", 200, None)
    reset.common_properties.duration.FromMilliseconds(4_500)
    assert timing_of(reset, ResponseReading(events=3)) == ReportedTiming(None, None, 4.5)


def reading_of_fields(fields: dict[str, Any]) -> ResponseReading:
    struct = struct_pb2.Struct()
    struct.update(fields)
    return reading_of(struct)


async def test_reported_streams_teach_the_decode_rate_from_the_first_token(harness: Harness) -> None:
    """81 tokens: the first 1 s after the start (queue + prefill), the last 2 s later: 40 tokens/s, where
    the span of the upstream bytes (the headers came at once) would have said 80 / 3 s."""
    s = harness.stream()
    key = admitted_metadata(await s.send(lean_body(chat(max_tokens=100, stream=True))))[REPORT_KEY]
    usage = json.dumps({"prompt_tokens": 9, "completion_tokens": 81})
    log = entry(key, 200, {"n": 81.0, "m": 81.0, "f": True, "x": True, "u": usage, "t1": 1_700_000_001_000.0})
    timed(log, first_byte_s=0.0, last_byte_s=3.0)
    await report(harness, log)
    await harness.settled()
    assert harness.sidecar.admission.paces.rate("*") == pytest.approx(40.0)
    await s.close()


# -- the end-report channel ----------------------------------------------------------------------------------


@pytest.fixture
async def patient() -> AsyncIterator[Harness]:
    """A sidecar that waits 30 s for an end report: a settlement sooner than that did not wait."""
    config = {**CONFIG, "admission": {**CONFIG["admission"], "end_report_wait_seconds": 30}}
    async with serving(config) as (sidecar, channel):
        yield LeanHarness(sidecar, channel)


async def test_the_last_access_log_stream_closing_loses_the_channel_and_frees_ended_leases(
    patient: Harness,
) -> None:
    harness = patient
    assert harness.metric("extproc_end_report_channel_up") == 1
    waiting = harness.stream()
    await waiting.send(lean_body(chat(max_tokens=40)))
    await waiting.close()  # ended on Envoy; its report would come within 30 s
    await eventually(lambda: harness.sidecar.unseen.awaiting_reports()[0].ended_at is not None)
    assert harness.metric("extproc_active_requests") == 1
    await report(harness, entry("from-before", 200, None))  # Envoy's only access-log stream opens and ends
    await eventually(lambda: harness.metric("extproc_end_report_channel_up") == 0)
    assert harness.metric("extproc_end_report_channel_losses_total", cause="stream_closed") == 1
    await harness.settled()  # the lease that waited: expired now, not after 30 s
    assert harness.metric("extproc_settlements_total", outcome="expired") == 1
    # While lost, a lease settles the moment its request ends.
    s = harness.stream()
    key = admitted_metadata(await s.send(lean_body(chat(max_tokens=40))))[REPORT_KEY]
    await s.close()
    await harness.settled()
    assert harness.metric("extproc_settlements_total", outcome="expired") == 2
    # Its late report proves the channel again (and settles nothing twice).
    await report(harness, entry(key, 200, None))
    assert harness.metric("extproc_end_reports_total", result="unknown") == 2
    # The stream closed again: lost once more, counted.
    await eventually(lambda: harness.metric("extproc_end_report_channel_losses_total") == 2)


async def end_three_requests_unreported(harness: Harness) -> None:
    """Three requests end, one after another, and no report comes for any: each lease expires, the channel
    counting as up until the third."""
    for done in range(1, 4):
        assert harness.metric("extproc_end_report_channel_up") == 1
        s = harness.stream()
        await s.send(lean_body(chat(max_tokens=40)))
        await s.close()
        await eventually(lambda n=done: harness.metric("extproc_settlements_total", outcome="expired") == n)


async def test_requests_ending_without_reports_lose_the_channel_after_three(harness: Harness) -> None:
    stub = als_pb2_grpc.AccessLogServiceStub(harness.channel)  # type: ignore[attr-defined]
    log_stream = stub.StreamAccessLogs()  # Envoy's stream: open, but its entries never come
    await log_stream.write(als_pb2.StreamAccessLogsMessage())
    await end_three_requests_unreported(harness)
    assert harness.metric("extproc_end_report_channel_up") == 0
    assert harness.metric("extproc_end_report_channel_losses_total", cause="misses") == 1
    log_stream.cancel()


async def test_a_channel_that_never_connected_is_lost_as_such_after_three_misses(harness: Harness) -> None:
    await end_three_requests_unreported(harness)
    assert harness.metric("extproc_end_report_channel_up") == 0
    assert harness.metric("extproc_end_report_channel_losses_total", cause="never_connected") == 1
    assert harness.metric("extproc_end_report_channel_losses_total", cause="misses") == 0


async def test_an_expired_lease_is_charged_the_prompts_exact_count_not_its_byte_bound(
    harness: Harness,
) -> None:
    """No access log ever connects: the lease expires, and its prompt is charged as counted (what a reported
    answer without usage is charged: the count the admission on the byte bound corrects to), not the
    bound."""
    body = lean_body(chat(max_tokens=40, content="hello there " * 200))
    prompt = functools.partial(harness.metric, "extproc_tokens_settled_total", kind="prompt")
    s = harness.stream()
    key = admitted_metadata(await s.send(body))[REPORT_KEY]
    await report(harness, entry(key, 200, {"n": 40.0}))
    await harness.settled()
    counted = prompt()
    await s.close()
    s = harness.stream()
    await s.send(body)
    await s.close()
    await eventually(lambda: harness.metric("extproc_settlements_total", outcome="expired") == 1)
    await harness.settled()
    assert 400 <= counted <= 450 and prompt() - counted == counted, (counted, prompt())
