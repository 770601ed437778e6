"""One request's life through admission, as an explicit state machine.

    NEW ──headers──▶ AWAITING_BODY ──body──▶ DECIDING ──▶ ADMITTED ──response headers──▶ RESPONDING
     │                    │                     │             │                               │
     └──▶ PASSTHROUGH     └──▶ REFUSED ◀────────┘             └────────── close() ──▶ SETTLED ◀┘

A protocol handler calls `request_headers`, `request_body`, `response_headers`, `response_body` and
`response_trailers` as the messages arrive, and `stream_ended()` however its stream ends (it may be called
any number of times: the lease settles once). Every method returns a verdict value (see `verdicts.py`);
none knows about gRPC or protobuf.

The exchange routes the request (headers), hands its body to the decision (`decision.py`), and once
admitted hands what it sees of the answer to the in-flight request (`inflight.py`), which settles it. In the
lean profile (`unseen` given) the proxy reads the answer and reports the end: the admitting `Forward`
carries the report ticket and the metadata the proxy needs, and `unseen.py` follows the request until then.

Whether a response is complete is decided only from what was seen (the end of the body, trailers, or the
final `[DONE]` event), never from how the transport ended: a proxy ends every stream the same way.
"""

from __future__ import annotations

import asyncio
import enum
import re
from collections.abc import AsyncIterator, Awaitable, Mapping
from dataclasses import dataclass, replace
from typing import TypeVar

from extproc.admission.apis import render_refusal
from extproc.admission.capacity.admitted import Admitted
from extproc.admission.deciding.candidate import RequestFacts
from extproc.admission.deciding.decision import Decision, Granted, Shadowed, refuse
from extproc.admission.deciding.provisional import Correction
from extproc.admission.intake.deadline import deadline_ms
from extproc.admission.intake.endpoint import picked_endpoint
from extproc.admission.intake.paths import BACKEND_CONTROL_HEADERS, RouteKind
from extproc.admission.intake.rules import TenantSource
from extproc.admission.replies import refusals
from extproc.admission.replies.headers import ratelimit_headers
from extproc.admission.replies.verdicts import (
    FORWARD,
    PASSTHROUGH,
    BodyVerdict,
    Forward,
    Header,
    Hold,
    Refusal,
    ReportTicket,
    RequestVerdict,
)
from extproc.admission.service import AdmissionService
from extproc.admission.tracking.answer import Answer
from extproc.admission.tracking.inflight import InFlight
from extproc.admission.tracking.reading import spec_for
from extproc.admission.tracking.unseen import UnseenStreams
from extproc.admission.vocabulary.errors import AdmissionError
from extproc.admission.vocabulary.names import (
    CONTENT_TYPE_HEADER,
    FAIRNESS_ID_HEADERS,
    FORWARDED_REQUEST_HEADERS,
    OBJECTIVE_HEADERS,
)

OFF_LOOP_FINISH_BYTES = 64 * 1024
"""A buffered response body larger than this is settled in a worker thread, not on the event loop."""

T = TypeVar("T")

_TENANT_RE = re.compile(r"[A-Za-z0-9._:@/-]{1,128}")


class Phase(enum.Enum):
    NEW = "new"
    PASSTHROUGH = "passthrough"
    AWAITING_BODY = "awaiting_body"
    DECIDING = "deciding"
    REFUSED = "refused"
    ADMITTED = "admitted"
    RESPONDING = "responding"
    SETTLED = "settled"


@dataclass(frozen=True, slots=True)
class RequestHead:
    """The request line and headers as the proxy saw them; `tenant` is the claim from the trusted source."""

    method: str
    path: str
    headers: Mapping[str, str]
    tenant: str | None = None
    end_of_stream: bool = False
    client: str | None = None  # the client's address, when the proxy sends it
    request_id: str | None = None  # the proxy's x-request-id (lean), to find a request it never forwarded


def _first(headers: Mapping[str, str], names: tuple[str, ...], trusted: bool) -> str:
    """The first of `names` the request carries, where the operator trusts them; else empty."""
    if trusted:
        for name in names:
            value = headers.get(name)
            if value:
                return value
    return ""


class Exchange:
    """One request: routing, its decision, and what is seen of its answer (see the module docstring)."""

    def __init__(self, service: AdmissionService, unseen: UnseenStreams | None = None) -> None:
        self.service = service
        self.unseen = unseen
        self._phase = Phase.NEW
        self.request: RequestFacts | None = None
        self.model_label = "unknown"
        self.inflight: InFlight | None = None
        self.response: Answer | None = None
        self.request_id: str | None = None
        self._closed = False

    @property
    def phase(self) -> Phase:
        inflight = self.inflight
        return Phase.SETTLED if inflight is not None and inflight.settled else self._phase

    @property
    def admitted(self) -> Admitted | None:
        """The admission this request holds (its plan corrected once a bound admission is counted)."""
        return self.inflight.admitted if self.inflight is not None else None

    @property
    def correction(self) -> Correction | None:
        """The exact count that follows an admission on the prompt's bound; None when counted first."""
        return self.inflight.correction if self.inflight is not None else None

    @property
    def finished(self) -> bool:
        """True once nothing more can happen: refused, passed through, or settled."""
        return self.phase in (Phase.REFUSED, Phase.PASSTHROUGH, Phase.SETTLED)

    def tenant_source(self) -> TenantSource:
        """Where a translator finds this request's tenant claim (header, metadata): the rules of now."""
        return self.service.rules().tenant

    # -- request --------------------------------------------------------------------------------------------

    def request_headers(self, head: RequestHead) -> RequestVerdict:
        rules = self.service.rules()
        # What the request claims of itself (its tenant, its objective), read before it is routed: reading
        # its headers is one step here, not one after each call elsewhere.
        claimed = head.tenant or _first(
            head.headers, FAIRNESS_ID_HEADERS, rules.pool_headers.trust_fairness_id
        )
        objective = _first(head.headers, OBJECTIVE_HEADERS, rules.pool_headers.trust_objective)
        rule = rules.paths.route(head.method, head.path)
        if rule is None:
            self._phase = Phase.REFUSED
            self.service.count("rejected", "unknown_path", "none", "none", None)
            return refusals.unknown_path(head.method, head.path)
        if rule.kind is not RouteKind.METERED or rule.api is None:
            self._phase = Phase.PASSTHROUGH
            self.service.count("passthrough", "free_path", "none", "none", None)
            return PASSTHROUGH
        self.request_id = head.request_id
        tenant = claimed if _TENANT_RE.fullmatch(claimed) else rules.tenant.default
        klass = rules.class_for(tenant, objective or None)
        content_type = head.headers.get(CONTENT_TYPE_HEADER)
        endpoint = picked_endpoint(head.headers, rules.pool_headers.trust_destination_endpoint)
        self.request = request = RequestFacts(
            rule.api, tenant, klass, head.client, content_type=content_type, endpoint=endpoint
        )
        try:
            deadline = deadline_ms(head.headers)
        except AdmissionError as exc:
            self._phase = Phase.REFUSED
            return refuse(self.service, rule.api, refusals.invalid(exc), "unknown", klass.name, tenant)
        if deadline is not None:
            arrived = self.service.clock()
            self.request = request = replace(
                request, deadline=arrived + deadline / 1000, deadline_ms=deadline
            )
        if head.end_of_stream:
            self._phase = Phase.REFUSED
            return refuse(
                self.service, request.api, refusals.empty_body(), "unknown", request.klass.name, tenant
            )
        # A `content-length` over the cap is refused after the body, not now: answered while the client is
        # still sending, the 413 goes out with `connection: close`, and Envoy, which never drains an unread
        # request body (envoyproxy/envoy#36080), resets the connection once its delayed_close_timeout (1 s)
        # passes: a client that writes the whole body before it reads (httpx, the openai SDK) then often gets
        # a reset instead of the 413. Envoy buffers the body up to its own bound first (envoy/envoy.yaml).
        self._phase = Phase.AWAITING_BODY
        # Headers the engines read to override the body (priority, data-parallel rank, model) never pass.
        control: tuple[str, ...] = ()
        for name in BACKEND_CONTROL_HEADERS:
            if name in head.headers:
                control += (name,)
        return Forward(remove_headers=control) if control else FORWARD

    async def request_body(self, body: bytes) -> AsyncIterator[BodyVerdict]:
        """Decide on the whole body: maybe `Hold` first (queued), then exactly one `Forward` or `Refusal`."""
        request = self.request
        if self._phase is not Phase.AWAITING_BODY or request is None:
            yield FORWARD
            return
        # BUFFERED mode delivers the whole body in one message. When trailers follow (HTTP/2, gRPC-web) it
        # comes with end_of_stream unset; waiting for more would let the request upstream unadmitted.
        self._phase = Phase.DECIDING
        service = self.service
        started = service.clock()
        rules = service.rules()  # read once: the whole decision is made under them
        decision = Decision(service, request)
        async for step in decision.run(body, rules):
            self.model_label = decision.model_label
            if isinstance(step, Hold):
                yield step
                continue
            verdict = self._outcome(step)
            outcome = "refused" if isinstance(verdict, Refusal) else "admitted"
            service.child(service.metrics.decision_seconds, outcome).observe(service.clock() - started)
            try:
                yield verdict
            finally:
                if self.inflight is not None:
                    # The proxy has the verdict: a bound admission's count is off its critical path.
                    self.inflight.start_correction()

    def _outcome(self, step: Granted | Refusal | Shadowed) -> Forward | Refusal:
        """The verdict for the decision's outcome, and the phase it leads to. Admitted in the lean profile,
        the proxy reads the answer and reports the end: the verdict says how, and carries the headers the
        proxy's route adds to the response and to the upstream request."""
        if isinstance(step, Refusal):
            self._phase = Phase.REFUSED
            return step
        if isinstance(step, Shadowed):
            self._phase = Phase.PASSTHROUGH
            return FORWARD
        self._phase = Phase.ADMITTED
        admitted, unseen = step.admitted, self.unseen
        inflight = self.inflight = InFlight(self.service, admitted, step.correction)
        inflight.request_id = self.request_id
        if self._closed:
            # The request ended while it waited (a cancel the wait swallowed): the proxy never had the
            # verdict, so nothing went upstream. Settle now, not at GC, refunded in full.
            inflight.never_forwarded()
            inflight.settle()
            return FORWARD
        if unseen is None:
            return step.forward
        ticket = ReportTicket(
            unseen.expect_report(inflight), spec_for(admitted.request.api), admitted.strip_usage
        )
        metadata = ratelimit_headers(admitted.lease.status)
        for header in step.forward.set_headers:
            if header[0] in FORWARDED_REQUEST_HEADERS:
                metadata += (header,)
        return replace(step.forward, report=ticket, metadata=metadata)

    # -- response (inline) ----------------------------------------------------------------------------------

    def response_headers(
        self,
        status: int | None,
        content_type: str,
        end_of_stream: bool,
        from_router: bool = True,
        engine_unreachable: bool = False,
        upstream_reset: bool = False,
    ) -> Forward | Refusal:
        """Record the upstream status, choose how to read usage, and add the `x-ratelimit-*` headers.
        `from_router` False: the response lacks what Envoy's router adds to every upstream answer, so a picker
        refusal status (`answer.PICKER_REFUSALS`) came from a filter after the sidecar and the request was not
        forwarded. An engine's own refusal (a 503, its queue full) is made a retryable one
        (`_engine_busy`); so is the proxy's own answer when it could not connect to any engine
        (`engine_unreachable`, its response flags: `_engine_unreachable`). `upstream_reset`: its flags say
        the engine's connection was reset after the request went to it (`Answer.open`)."""
        inflight = self.inflight
        if inflight is None or self.phase is not Phase.ADMITTED:
            return FORWARD
        admitted = inflight.admitted
        self.response = response = Answer.open(
            admitted, status, content_type, end_of_stream, from_router, engine_unreachable, upstream_reset
        )
        self._phase = Phase.RESPONDING
        seen = response.seen()
        inflight.observe(seen)
        headers = ratelimit_headers(admitted.lease.status)
        if response.engine_unreachable:
            return self._engine_unreachable(inflight)
        if seen.facts.engine_busy:
            return self._engine_busy(inflight, headers, content_type)
        return Forward(set_headers=headers)

    def _engine_busy(
        self, inflight: InFlight, headers: tuple[Header, ...], content_type: str
    ) -> Forward | Refusal:
        """The engine refused the request, its queue full: nothing more will come of it but the error body,
        so the lease settles now (refunded in full) and the client is told when to come back. The engine's
        body passes where it is JSON (vLLM's OpenAI error); any other body is answered in its place with the
        sidecar's own error, in the envelope this API's clients parse."""
        inflight.settle()
        admitted = inflight.admitted
        retry_after_s = self.service.engine_retry_after(admitted)
        if "json" in content_type.lower():
            return Forward(set_headers=(*headers, *refusals.engine_busy_headers(retry_after_s)))
        return render_refusal(admitted.request.api, refusals.engine_busy(retry_after_s, headers))

    def _engine_unreachable(self, inflight: InFlight) -> Refusal:
        """The proxy could not connect to any engine for this admitted request and answered itself: nothing
        was sent, so the lease settles now (`engine_unreachable`, refunded in full), and the client gets the
        refusal the sidecar sends up front once the feed shows the pool down, with its reason and retry hint
        (the outage's length where the feed knows it already, else the least)."""
        inflight.settle()
        admitted = inflight.admitted
        down_for = self.service.deps.engine_down_for(admitted.pool)
        refusal = refusals.engine_down(admitted.request.model, refusals.engine_down_retry_after(down_for))
        return render_refusal(admitted.request.api, refusal)

    async def response_body(self, chunk: bytes, end_of_stream: bool) -> Forward | Refusal:
        """Follow usage (removing the usage event the client did not ask for); maybe cut under pressure."""
        response, inflight = self.response, self.inflight
        if response is None or inflight is None or self.phase is not Phase.RESPONDING:
            return FORWARD
        if not end_of_stream:
            cut = inflight.cut()
            if cut is not None:
                inflight.settle()  # as a cut: prompt + what was streamed
                return cut
        tracker = response.tracker
        if response.first_chunk_at is None and chunk:
            response.first_chunk_at = self.service.clock()
        response.passed_bytes += len(chunk)
        out = tracker.feed(chunk)
        inflight.observe(response.seen(live=True))
        if not end_of_stream:
            return FORWARD if out is None else Forward(body=out)
        if tracker.buffered_bytes > OFF_LOOP_FINISH_BYTES:
            # A large JSON answer without usage is parsed and tokenized: keep other streams flowing.
            deps = self.service.deps
            executor = deps.settle_executor or deps.executor
            tail = await asyncio.get_running_loop().run_in_executor(executor, tracker.finish)
        else:
            tail = tracker.finish()
        if tail is not None:
            out = (chunk if out is None else out) + tail
        response.completed = True
        first = response.first_chunk_at
        decode_s = self.service.clock() - first if first is not None else None
        inflight.observe(response.seen(decode_s=decode_s))
        # The upstream's answer is whole: the engine's work ended here, however slowly the client reads the
        # rest out of the proxy's buffers, so the lease ends now, not when the client is done.
        inflight.settle()
        return FORWARD if out is None else Forward(body=out)

    def response_trailers(self) -> None:
        if self.response is not None and self.inflight is not None:
            self.response.completed = True
            self.inflight.observe(self.response.seen())

    async def next_or_cut(self, following: Awaitable[T]) -> T | Refusal:
        """`following` (the stream's next message), or, in the lean profile, the cut admission decides while
        the unseen answer streams (`UnseenStreams.next_or_cut`)."""
        if self.unseen is None:
            return await following
        return await self.unseen.next_or_cut(self.inflight, following)

    # -- end ------------------------------------------------------------------------------------------------

    def reply_undelivered(self) -> None:
        """The transport never took the last reply: the proxy reset the stream first (its message timeout
        fired, or the client left). Where that reply admitted the request, the proxy never had the verdict
        and, failing closed, sent nothing upstream: it settles as not forwarded, refunded in full (the lean
        profile keeps that for an end report that might still say otherwise)."""
        if self._phase is Phase.ADMITTED and self.inflight is not None:
            self.inflight.never_forwarded()

    def close(self) -> None:
        """Settle now with what is known, if a lease is held. Safe to call repeatedly."""
        self._closed = True
        if self.inflight is not None:
            self.inflight.settle()

    def stream_ended(self) -> None:
        """The protocol stream ended, however it ended. A request whose end the proxy reports waits for
        that report (bounded); anything else settles now."""
        inflight = self.inflight
        if self.unseen is not None and inflight is not None and inflight.awaiting_report:
            self._closed = True
            self.unseen.ended(inflight)
        else:
            self.close()
