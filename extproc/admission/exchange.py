"""One request's life through admission, as an explicit state machine.

    NEW ──headers──▶ AWAITING_BODY ──body──▶ DECIDING ──▶ ADMITTED ──response headers──▶ RESPONDING
     │                    │                     │             │                               │
     └──▶ PASSTHROUGH     └──▶ REFUSED ◀────────┘             └────────── close() ──▶ SETTLED ◀┘

A protocol handler calls `request_headers`, `request_body`, `response_headers`, `response_body` and
`response_trailers` as the messages arrive, and `close()` however the request ends (it may be called any
number of times: the lease settles once). Every method returns a verdict value (see `verdicts.py`); none
knows about gRPC or protobuf.

Whether a response is complete is decided only from what was seen (the end of the body, trailers, or the
final `[DONE]` event), never from how the transport ended: a proxy ends every stream the same way.
"""

from __future__ import annotations

import asyncio
import enum
import functools
import itertools
import logging
import math
import re
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, replace

from extproc.admission import provisional, refusals
from extproc.admission.apis import dialect_for, render_refusal
from extproc.admission.errors import AdmissionError
from extproc.admission.headers import ratelimit_headers
from extproc.admission.lanes import LaneFull
from extproc.admission.paths import BACKEND_CONTROL_HEADERS, RouteKind
from extproc.admission.policy import ModelPolicy
from extproc.admission.reading import ReadSpec, ReportedTiming, ResponseReading, facts_of, spec_for
from extproc.admission.request import (
    USAGE_OPTION_APIS,
    Api,
    BodyEdits,
    ParsedRequest,
    Reservation,
    edit_body,
    parse_request,
    plan_reservation,
    prompt_token_lower_bound,
)
from extproc.admission.service import AdmissionService, Admitted
from extproc.admission.settlement import ResponseFacts, settle_charge
from extproc.admission.usage import ResponseUsageTracker
from extproc.admission.verdicts import (
    FORWARD,
    PASSTHROUGH,
    BodyVerdict,
    Forward,
    Hold,
    Refusal,
    RequestVerdict,
)
from extproc.config import ClassConfig, Config
from extproc.core.kv_budget import KvBudget
from extproc.core.limiter import Lease, Rejection
from extproc.core.ports import StoreUnavailable
from extproc.core.slot_eta import OpenLease
from extproc.queueing import WAITABLE, QueueFull

log = logging.getLogger(__name__)

OFF_LOOP_PARSE_BYTES = 64 * 1024
"""A request body larger than this is parsed in a worker thread (with its tokenizing), not on the loop."""

OFF_LOOP_FINISH_BYTES = 64 * 1024
"""A buffered response body larger than this is settled in a worker thread, not on the event loop."""

PICKER_REFUSALS = frozenset({429, 503})
"""The statuses an inference pool's endpoint picker refuses with (ImmediateResponse 429: shed; 503: no ready
endpoint; gateway-api-inference-extension v1.6.0 docs/proposals/004-endpoint-picker-protocol). Inline, only
these, without the router's header, count as never forwarded: Envoy's router makes its own 502 and 504
without that header too, after the backend may have read the prompt, and they keep the backend-error rule.
Its own 503 (connection failure, or a reset before the response) is refunded in full like a picker's: the
inline profile cannot tell them apart; the lean one can (no byte sent upstream)."""

_TENANT_RE = re.compile(r"[A-Za-z0-9._:@/-]{1,128}")

_BUDGET_IDS = itertools.count()
"""KV-budget lease ids: a request is booked before the limiter grants (and numbers) its lease."""


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


@dataclass(slots=True)
class _Response:
    """What has been seen of the upstream's answer, and when (for the pool's decode rate)."""

    status: int | None
    tracker: ResponseUsageTracker
    streaming: bool = False
    completed: bool = False
    cut: bool = False
    first_chunk_at: float | None = None
    forwarded: bool = True


class Exchange:
    """One request: routing, admission, response tracking and settlement (see the module docstring)."""

    def __init__(self, service: AdmissionService) -> None:
        self.service = service
        self.phase = Phase.NEW
        self.api: Api | None = None
        self.tenant = "default"
        self.klass: ClassConfig | None = None
        self.model_label = "unknown"
        self.admitted: Admitted | None = None
        self.response: _Response | None = None
        self._policy: ModelPolicy | None = None
        self.pool: str | None = None
        self.client: str | None = None
        self._closed = False
        # Lean profile: the key the proxy's end report names, when the request ended, whether it was cut.
        self.report_key: str | None = None
        self.ended_at: float | None = None
        self._cut_unseen = False
        self._correction: provisional.Correction | None = None  # set when admitted on a bound

    @property
    def class_name(self) -> str:
        return self.klass.name if self.klass is not None else "none"

    @property
    def correction(self) -> provisional.Correction | None:
        """The exact count that follows an admission on the prompt's bound; None when counted first."""
        return self._correction

    @property
    def finished(self) -> bool:
        """True once nothing more can happen: refused, passed through, or settled."""
        return self.phase in (Phase.REFUSED, Phase.PASSTHROUGH, Phase.SETTLED)

    def _refuse(self, refusal: Refusal) -> Refusal:
        refusal = render_refusal(self.api, refusal)  # in the error envelope this API's clients parse
        self.phase = Phase.REFUSED
        self.service.count("rejected", refusal.reason, self.model_label, self.class_name, self.tenant)
        log.info(
            "request refused",
            extra={"status": refusal.status, "reason": refusal.reason, "model": self.model_label},
        )
        return refusal

    # -- request headers ------------------------------------------------------------------------------------

    def request_headers(self, head: RequestHead) -> RequestVerdict:
        config = self.service.config()
        rule = config.paths.route(head.method, head.path)
        if rule is None:
            self.phase = Phase.REFUSED
            self.service.count("rejected", "unknown_path", "none", "none", None)
            return refusals.unknown_path(head.method, head.path)
        if rule.kind is not RouteKind.METERED or rule.api is None:
            self.phase = Phase.PASSTHROUGH
            self.service.count("passthrough", "free_path", "none", "none", None)
            return PASSTHROUGH
        self.api = rule.api
        self.client = head.client
        claimed = head.tenant or ""
        self.tenant = claimed if _TENANT_RE.fullmatch(claimed) else config.admission.tenant.default
        self.klass = config.class_of(self.tenant)
        if head.end_of_stream:
            return self._refuse(refusals.empty_body())
        # A `content-length` over the cap is refused after the body, not now: answered while the client is
        # still sending, the 413 goes out with `connection: close`, and Envoy, which never drains an unread
        # request body (envoyproxy/envoy#36080), resets the connection once its delayed_close_timeout (1 s)
        # passes: a client that writes the whole body before it reads (httpx, the openai SDK) then often gets
        # a reset instead of the 413. Envoy buffers the body up to its own bound first (envoy/envoy.yaml).
        self.phase = Phase.AWAITING_BODY
        # Headers the engines read to override the body (priority, data-parallel rank, model) never pass.
        control = tuple(h for h in BACKEND_CONTROL_HEADERS if h in head.headers)
        return Forward(remove_headers=control) if control else FORWARD

    # -- request body ---------------------------------------------------------------------------------------

    async def request_body(self, body: bytes) -> AsyncIterator[BodyVerdict]:
        """Decide on the whole body: maybe `Hold` first (queued), then exactly one `Forward` or `Refusal`."""
        if self.phase is not Phase.AWAITING_BODY:
            yield FORWARD
            return
        # BUFFERED mode delivers the whole body in one message. When trailers follow (HTTP/2, gRPC-web) it
        # comes with end_of_stream unset; waiting for more would let the request upstream unadmitted.
        self.phase = Phase.DECIDING
        started = self.service.clock()
        async for verdict in self._decide(body, self.service.config()):
            if not isinstance(verdict, Hold):
                outcome = "refused" if isinstance(verdict, Refusal) else "admitted"
                decision = self.service.child(self.service.metrics.decision_seconds, outcome)
                decision.observe(self.service.clock() - started)
            yield verdict

    async def _decide(self, raw: bytes, config: Config) -> AsyncIterator[BodyVerdict]:
        cap = config.admission.max_body_bytes
        if len(raw) > cap:
            yield self._refuse(refusals.too_large(len(raw), cap))
            return
        try:
            parsed = await self._parse(raw, config)
            on_bound = await self._admit_on_bound(parsed, config)  # no count yet (provisional.py)
            plan = await self._count(parsed, config) if on_bound is None else None
        except AdmissionError as exc:
            yield self._refuse(refusals.invalid(exc))
            return
        except LaneFull:
            yield self._refuse(refusals.tokenizer_busy())
            return
        if on_bound is not None:
            try:
                yield on_bound
            finally:
                self._start_correction()  # the proxy has the verdict: the count is off its critical path
            return
        assert plan is not None
        assert self.klass is not None and self.pool is not None
        shadow = config.shadow or self.klass.shadow
        budget = self.service.deps.kv_budget(self.pool)
        if budget is not None:
            now = self.service.clock()
            fits, headroom = budget.would_fit(
                plan.prompt_tokens,
                plan.completion_tokens,
                self.tenant,
                now=now,
                sequences=parsed.sequences * parsed.prompt_count,
                committed=plan.committed_completion_tokens,
            )
            if not fits:
                wait = refusals.kv_retry_after(budget, self.service.retry_hints, self.pool, now)
                refusal = refusals.kv_budget(parsed.model, plan.total, headroom or 0, wait)
                yield self._shadow_pass(refusal.reason) if shadow else self._refuse(refusal)
                return
        facts, new_body, strip_usage = self._forwarding(parsed, plan, config)
        keys = self._keys()
        result: Lease | Rejection | Refusal | None = None
        # Book the KV before the limiter's await, so that concurrent decisions see each other's.
        held = self._hold_kv(budget, parsed, plan)
        try:
            async for step in self._acquire(keys, plan.total, shadow):
                if isinstance(step, Hold):
                    yield step
                else:
                    result = step
        finally:
            if budget is not None and not isinstance(result, Lease):
                budget.release(held)  # refused, or the caller went away while it waited
                self.service.deps.budget_changed(self.pool)
        if isinstance(result, Refusal):
            yield self._refuse(result)
            return
        if isinstance(result, Rejection):
            refusal = refusals.rate_limited(self.service.retry_hint(result), facts.model, plan.total)
            yield self._shadow_pass(refusal.reason) if shadow else self._refuse(refusal)
            return
        assert isinstance(result, Lease)
        yield self._admit(result, facts, plan, budget, held, strip_usage=strip_usage, new_body=new_body)

    def _forwarding(
        self, parsed: ParsedRequest, plan: Reservation, config: Config
    ) -> tuple[ParsedRequest, bytes | None, bool]:
        """The admission facts kept (not the parsed body: a waiting request must not hold megabytes of
        JSON), the edited body (None: unchanged), and whether to strip a usage event the client did not
        ask for."""
        assert self.klass is not None
        edits = BodyEdits(
            include_usage=config.admission.inject_include_usage,
            max_tokens=plan.injected_max_tokens,
            strip_priority=True,
            priority=self.klass.backend_priority,
        )
        new_body = edit_body(parsed, edits)
        strip_usage = (
            edits.include_usage
            and parsed.stream
            and not parsed.include_usage
            and parsed.api in USAGE_OPTION_APIS
        )
        return replace(parsed, body={}), new_body, strip_usage

    def _keys(self) -> list[str]:
        return ["global", f"model:{self.pool}", f"tenant:{self.tenant}"]

    async def _admit_on_bound(self, parsed: ParsedRequest, config: Config) -> Forward | Refusal | None:
        """Admit on the prompt's upper bound where it decides, the exact count to follow (`provisional.py`).

        Returns the verdict, or None when the request must be counted first: near the window,
        when the bound does not fit the KV budget or a bucket, or when it must queue. Nothing is held then.
        """
        assert self.klass is not None and self.pool is not None and self._policy is not None
        bound = provisional.bound_plan(parsed, self._policy, config.admission.per_step)
        budget = self.service.deps.kv_budget(self.pool)
        if bound is None or not provisional.may_admit_on_bound(
            self.service, self.klass, budget, parsed, bound, self.tenant, self.tokenizer_lane
        ):
            return None
        held = self._hold_kv(budget, parsed, bound)
        result: Lease | Rejection | None = None
        try:
            result = await self.service.acquire(self._keys(), bound.total, self.klass.name)
        except StoreUnavailable:
            return self._refuse(refusals.store_unavailable())
        finally:
            if budget is not None and not isinstance(result, Lease):
                budget.release(held)
                self.service.deps.budget_changed(self.pool)
        if not isinstance(result, Lease):
            return None  # a bucket or a slot said no: count, and decide on the exact need
        facts, new_body, strip_usage = self._forwarding(parsed, bound, config)
        self._correction = provisional.Correction(self.service, self.tokenizer_lane)
        return self._admit(result, facts, bound, budget, held, strip_usage=strip_usage, new_body=new_body)

    def _start_correction(self) -> None:
        """Count a bound admission exactly: once the proxy has its verdict, or once it ends if that is
        sooner (its settlement waits for the count). Idempotent."""
        if self._correction is not None and self.admitted is not None:
            self._correction.start(self.admitted, self._corrected)

    def _corrected(self, admitted: Admitted) -> None:
        self.admitted = admitted

    def _hold_kv(self, budget: KvBudget | None, parsed: ParsedRequest, plan: Reservation) -> str:
        """Record the request in the pool's KV budget under an id of its own; returns that id."""
        held = f"x{next(_BUDGET_IDS)}"
        if budget is not None:
            budget.admit(
                held,
                plan.prompt_tokens,
                plan.completion_tokens,
                self.tenant,
                now=self.service.clock(),
                sequences=parsed.sequences * parsed.prompt_count,
                committed=plan.committed_completion_tokens,
            )
            assert self.pool is not None
            self.service.deps.budget_changed(self.pool)
        return held

    async def _acquire(
        self, keys: list[str], tokens: int, shadow: bool
    ) -> AsyncIterator[Lease | Rejection | Refusal | Hold]:
        """Take a lease now, or wait for one in the class's queue; yields `Hold` before waiting, then the
        result: a lease, the limiter's rejection, or a refusal (queue full or timed out, store down)."""
        klass = self.klass
        assert klass is not None
        queue = self.service.deps.queue
        waits = queue is not None and klass.queues and not shadow
        behind = queue is not None and queue.must_queue(klass.name)
        result: Lease | Rejection | None = None
        try:
            if not (behind and waits):
                # Waiters of a higher class are ahead: a class that does not queue may still use its own
                # guarantee, but not the pool they are waiting for.
                result = await self.service.acquire(keys, tokens, klass.name, use_pool=not behind)
            if waits and (result is None or (isinstance(result, Rejection) and result.reason in WAITABLE)):
                assert queue is not None
                # The proxy's per-message timer must not fire while the request waits for capacity.
                yield Hold(math.ceil(klass.max_wait_seconds) + 1)
                try:
                    result = await queue.wait(keys, tokens, klass.name, self.tenant, klass.max_wait_seconds)
                except QueueFull:
                    yield refusals.queue_refused("queue_full", klass.name, klass.max_wait_seconds)
                    return
                if result is None:
                    yield refusals.queue_refused("queue_timeout", klass.name, klass.max_wait_seconds)
                    return
        except StoreUnavailable:
            yield refusals.store_unavailable()
            return
        assert result is not None
        yield result

    def _shadow_pass(self, reason: str) -> Forward:
        """Shadow mode: count and log what enforcement would have refused, then let it through.

        The request holds no lease, so the limiter keeps evolving exactly as it would under enforcement.
        """
        self.phase = Phase.PASSTHROUGH
        self.service.count("shadow_rejected", reason, self.model_label, self.class_name, self.tenant)
        log.info("shadow mode: would refuse", extra={"reason": reason, "class": self.class_name})
        return FORWARD

    def _admit(
        self,
        lease: Lease,
        facts: ParsedRequest,
        plan: Reservation,
        budget: KvBudget | None,
        budget_id: str,
        strip_usage: bool,
        new_body: bytes | None,
    ) -> Forward:
        service = self.service
        assert self.klass is not None and self._policy is not None
        assert self.pool is not None
        self.admitted = Admitted(
            lease=lease,
            request=facts,
            policy=self._policy,
            pool=self.pool,
            plan=plan,
            tenant=self.tenant,
            klass=self.klass,
            model_label=self.model_label,
            budget=budget,
            budget_id=budget_id,
            strip_usage=strip_usage,
            admitted_at=service.clock(),
        )
        self.phase = Phase.ADMITTED
        service.count("admitted", "ok", self.model_label, self.class_name, self.tenant)
        service.child(service.metrics.tokens_reserved, self.model_label).inc(plan.total)
        service.metrics.active.inc()
        if self._closed:
            # The request ended while it waited (a cancel the wait swallowed): settle now, not at GC.
            self._settle()
            return FORWARD
        headers: tuple[tuple[str, str], ...] = ()
        if self.klass.backend_priority is not None:
            # vLLM reads the header on every API (the Messages API has no body field for it).
            headers = (("x-vllm-priority", str(self.klass.backend_priority)),)
        if new_body is None:
            return Forward(set_headers=headers) if headers else FORWARD
        return Forward(set_headers=(*headers, ("content-length", str(len(new_body)))), body=new_body)

    async def _parse(self, raw: bytes, config: Config) -> ParsedRequest:
        """Parse, resolve the model's policy and pool, refuse a prompt whose lower bound is too long."""
        assert self.api is not None
        service = self.service
        stored = config.admission.allow_stored_context
        if len(raw) > OFF_LOOP_PARSE_BYTES:
            # A large body can hold tens of thousands of small messages: parsing it takes tens of ms, on a
            # worker thread, through the client's lane like its counting.
            parse = functools.partial(
                parse_request, allow_stored_context=stored, bounds=config.admission.per_step
            )
            parsed = await service.lanes.run(self.tokenizer_lane, parse, self.api, raw)
        else:
            parsed = parse_request(
                self.api, raw, allow_stored_context=stored, bounds=config.admission.per_step
            )
        served_as = service.deps.served_as(parsed.model, config)
        policy = config.model_policy(served_as) if served_as is not None else None
        if served_as is None or policy is None:
            raise AdmissionError(
                404, f"The model `{parsed.model}` does not exist.", code="model_not_found", param="model"
            )
        self.pool = config.pool_of(served_as)
        self.model_label = config.model_label(self.pool)
        self._policy = policy
        self._check_template(parsed, config)
        lower = prompt_token_lower_bound(parsed, policy)
        if lower >= policy.context_window + (0 if parsed.generates else 1):
            raise AdmissionError(
                400,
                f"This model's maximum context length is {policy.context_window} tokens. However, your "
                f"request has at least {lower} input tokens. Please reduce the length of the input.",
                code="context_length_exceeded",
                param=parsed.prompt_param,
            )
        return parsed

    async def _count(self, parsed: ParsedRequest, config: Config) -> Reservation:
        """Count the prompt exactly and size the reservation on it."""
        service, policy = self.service, self._policy
        assert policy is not None
        started = service.clock()
        counts = await service.count_prompts(parsed, policy, self.tokenizer_lane)
        service.metrics.tokenize_seconds.observe(service.clock() - started)
        return plan_reservation(parsed, counts, policy, config.admission.per_step)

    def _check_template(self, parsed: ParsedRequest, config: Config) -> None:
        """A request-supplied chat template can expand a small body into a huge prompt: refuse it unless the
        operator trusts clients with it (`admission.allow_request_chat_template`)."""
        if config.admission.allow_request_chat_template:
            return
        key = parsed.custom_template
        if key is not None:
            raise AdmissionError(
                400,
                f"'{key}' is not accepted by this gateway; the server's own chat template is used.",
                code="unsupported_parameter",
                param=key,
            )

    @property
    def tokenizer_lane(self) -> str:
        """Whose share of the tokenizer threads this request uses: its tenant, or its client address."""
        if self.tenant == self.service.config().admission.tenant.default and self.client:
            return f"client:{self.client}"
        return f"tenant:{self.tenant}"

    # -- response -------------------------------------------------------------------------------------------

    def response_headers(
        self, status: int | None, content_type: str, end_of_stream: bool, from_router: bool = True
    ) -> Forward:
        """Record the upstream status, choose how to read usage, and add the `x-ratelimit-*` headers.
        `from_router` False: the response lacks what Envoy's router adds to every upstream answer, so a picker
        refusal status (PICKER_REFUSALS) came from a filter after the sidecar and the request was not
        forwarded."""
        admitted = self.admitted
        if admitted is None or self.phase is not Phase.ADMITTED:
            return FORWARD
        streaming = "text/event-stream" in content_type
        ok = status is not None and status < 400
        tracker = ResponseUsageTracker(
            streaming=streaming,
            encoding=admitted.policy.encoding,
            strip_usage_chunk=admitted.strip_usage and streaming and ok,
            dialect=dialect_for(admitted.request.api),
        )
        self.response = _Response(
            status=status,
            tracker=tracker,
            streaming=streaming,
            completed=end_of_stream,
            forwarded=from_router or ok or status not in PICKER_REFUSALS,
        )
        self.phase = Phase.RESPONDING
        return Forward(set_headers=ratelimit_headers(admitted.lease.status))

    async def response_body(self, chunk: bytes, end_of_stream: bool) -> Forward | Refusal:
        """Follow usage (removing the usage event the client did not ask for); maybe cut under pressure."""
        response, admitted = self.response, self.admitted
        if response is None or admitted is None or self.phase is not Phase.RESPONDING:
            return FORWARD
        if not end_of_stream and self._should_cut(admitted):
            return self._cut(response)
        tracker = response.tracker
        if response.first_chunk_at is None and chunk:
            response.first_chunk_at = self.service.clock()
        out = tracker.feed(chunk)
        if admitted.budget is not None:
            # Only a stream's chunks time its progress (a JSON body arrives whole at the end).
            now = self.service.clock() if response.streaming else None
            admitted.budget.progress(admitted.budget_id, tracker.usage.completion_tokens, now)
        if end_of_stream:
            if tracker.buffered_bytes > OFF_LOOP_FINISH_BYTES:
                # A large JSON answer without usage is parsed and tokenized: keep other streams flowing.
                executor = self.service.deps.settle_executor or self.service.deps.executor
                tail = await asyncio.get_running_loop().run_in_executor(executor, tracker.finish)
            else:
                tail = tracker.finish()
            if tail is not None:
                out = (chunk if out is None else out) + tail
            response.completed = True
            self._learn_decode_rate(admitted, response)
            # The upstream's answer is whole: the engine's work ended here, however slowly the client reads
            # the rest out of the proxy's buffers, so the lease ends now, not when the client is done.
            self._settle()
        return FORWARD if out is None else Forward(body=out)

    def _learn_decode_rate(self, admitted: Admitted, response: _Response) -> None:
        """A completed stream tells how fast the pool decodes: tokens after the first over their duration."""
        if not response.streaming or response.first_chunk_at is None or response.status != 200:
            return
        sequences = admitted.request.sequences * admitted.request.prompt_count
        tokens = response.tracker.usage.completion_tokens / max(1, sequences) - 1
        seconds = self.service.clock() - response.first_chunk_at
        self.service.decode_rates.observe(admitted.pool, tokens, seconds)

    def response_trailers(self) -> None:
        if self.response is not None:
            self.response.completed = True

    def _should_cut(self, admitted: Admitted) -> bool:
        threshold = admitted.klass.cut_streams_above_kv
        if threshold is None:
            return False
        usage = self.service.deps.kv_usage(admitted.pool)
        return usage is not None and usage > threshold

    def _cut(self, response: _Response) -> Refusal:
        """Reset this stream: the proxy drops the chunk and resets client and upstream, and the backend frees
        the sequence's KV blocks. Settles as a cut (prompt + what was streamed)."""
        response.cut = True
        self.service.metrics.streams_cut.labels(self.class_name).inc()
        log.warning(
            "stream cut under KV pressure", extra={"class": self.class_name, "model": self.model_label}
        )
        self._settle()
        return refusals.cut_under_kv_pressure()

    def open_lease(self, key: str) -> OpenLease | None:
        """This request as an open lease on `key` (for slot retry hints), or None if it holds none there."""
        admitted = self.admitted
        if admitted is None or self.phase not in (Phase.ADMITTED, Phase.RESPONDING):
            return None
        if key not in admitted.lease.keys:
            return None
        streamed = self.response.tracker.usage.completion_tokens if self.response is not None else 0
        return self.service.open_lease(admitted, streamed)

    # -- end ------------------------------------------------------------------------------------------------

    def close(self) -> None:
        """The request ended, however it ended: settle the lease if one is held. Safe to call repeatedly."""
        self._closed = True
        if self.admitted is not None and self.phase in (Phase.ADMITTED, Phase.RESPONDING):
            self._settle()

    def facts(self) -> ResponseFacts:
        """What is known of the response now; nothing seen yet means the backend's work is estimated."""
        response, admitted = self.response, self.admitted
        if response is None:
            if admitted is None:
                return ResponseFacts()
            return ResponseFacts(estimated_completion=self._estimate(admitted))
        tracker = response.tracker
        completed = response.completed or tracker.done_seen
        unfinished = None
        if not completed and response.first_chunk_at is not None:
            unfinished = self._estimate_streamed(admitted, self._until() - response.first_chunk_at)
        return ResponseFacts(
            upstream_status=response.status,
            completed=completed,
            cut=response.cut,
            usage=tracker.usage,
            error_seen=tracker.error_seen,
            estimated_completion=unfinished or 0,
            forwarded=response.forwarded,
        )

    def _until(self) -> float:
        return self.ended_at if self.ended_at is not None else self.service.clock()

    def _estimate_streamed(self, admitted: Admitted | None, decoding_s: float | None) -> int | None:
        """What the engine generated for an answer that was seen streaming but not to its end: the pool's
        learned rate over `decoding_s` since the first token (one token each before it), capped by the
        reservation. None without a learned rate: the tokens that passed are then the only evidence."""
        if admitted is None or decoding_s is None:
            return None
        rates = self.service.decode_rates
        if not rates.learned(admitted.pool):
            return None
        request = admitted.request
        sequences = request.sequences * request.prompt_count
        cap = admitted.plan.completion_tokens
        return min(cap, sequences + rates.estimate(admitted.pool, decoding_s, sequences, cap))

    def _estimate(self, admitted: Admitted) -> int:
        """Completion tokens the backend may have generated unseen: the pool's decode rate over the time
        from admission to the end of the request (or to now), capped by the reservation."""
        request = admitted.request
        return self.service.decode_rates.estimate(
            admitted.pool,
            self._until() - admitted.admitted_at,
            request.sequences * request.prompt_count,
            admitted.plan.completion_tokens,
        )

    def _settle(self, facts: ResponseFacts | None = None) -> None:
        admitted = self.admitted
        if admitted is None or self.phase is Phase.SETTLED:
            return
        # Book the settlement on the first attempt, whatever the store answers: a shared store answers False
        # for a lease that already expired there, and the request still ended here.
        self.phase = Phase.SETTLED
        if self.report_key is not None:
            self.service.forget_report(self.report_key)
        facts = self.facts() if facts is None else facts
        correction = self._correction
        if correction is not None and correction.defer(functools.partial(self._charge, facts)):
            self._start_correction()
            return  # admitted on a bound: settled with the exact count once it is in (provisional.py)
        self._charge(facts, admitted)

    def _charge(self, facts: ResponseFacts, admitted: Admitted) -> None:
        self.service.settle(admitted, settle_charge(admitted.plan.prompt_tokens, facts))

    # -- end report (lean profile) --------------------------------------------------------------------------
    # The proxy reads the response (extproc/admission/reading.py) and reports when the request ended; the
    # exchange stays ADMITTED until that report, or until its bounded wait expires.

    def expect_report(self) -> tuple[str, ReadSpec]:
        """Register for the proxy's end report: the key the report will name and how to read the answer."""
        assert self.admitted is not None and self.phase is Phase.ADMITTED
        self.report_key = self.service.expect_report(self)
        return self.report_key, spec_for(self.admitted.request.api)

    @property
    def awaiting_report(self) -> bool:
        return self.report_key is not None and self.phase is Phase.ADMITTED

    def mark_ended(self) -> None:
        """The request ended on the proxy (its ext_proc stream closed): the estimate stops growing here."""
        if self.ended_at is None:
            self.ended_at = self.service.clock()

    def report(
        self,
        status: int | None,
        reading: ResponseReading,
        timing: ReportedTiming | None = None,
        forwarded: bool = True,
    ) -> None:
        """Settle from the proxy's end report: the response code (None: no response started), what its
        reader saw, when the answer's tokens came (for the decode rate and the KV budget's pace), and
        whether any byte of the request was sent upstream (`forwarded`)."""
        admitted = self.admitted
        if admitted is None or self.phase is not Phase.ADMITTED:
            return
        facts = facts_of(status, reading, admitted.request.api, admitted.policy.encoding)
        if not forwarded:
            facts = replace(facts, forwarded=False)
        if self._cut_unseen:
            facts = replace(facts, cut=True)
        elif facts.upstream_status is None and not facts.completed:
            facts = replace(facts, estimated_completion=self._estimate(admitted))
        elif not facts.completed and reading.streamed and timing is not None:
            # Seen streaming, not to its end (a slow reader cut at the lifetime bound, a client gone): the
            # engine generated at its pace up to the last upstream byte, whatever the client read.
            streamed = self._estimate_streamed(admitted, timing.decode_s)
            facts = replace(facts, estimated_completion=streamed or 0)
        if reading.streamed and timing is not None:
            self._learn_reported_rate(admitted, facts, timing)
        self._settle(facts)

    def expire(self) -> None:
        """No end report within the bound (its sender was down, or it was lost): settle as `expired`, with
        the decode-rate estimate of what the backend generated until the request ended."""
        admitted = self.admitted
        if admitted is None or self.phase is not Phase.ADMITTED:
            return
        self._settle(ResponseFacts(expired=True, estimated_completion=self._estimate(admitted)))

    def cut_unseen(self) -> Refusal | None:
        """Lean profile: the refusal that resets this stream when its class is cut under the pool's KV
        pressure, else None. The lease settles from the end report, which brings what was streamed."""
        admitted = self.admitted
        if admitted is None or self.phase is not Phase.ADMITTED or self._cut_unseen:
            return None
        if not self._should_cut(admitted):
            return None
        self._cut_unseen = True
        self.service.metrics.streams_cut.labels(self.class_name).inc()
        log.warning(
            "stream cut under KV pressure", extra={"class": self.class_name, "model": self.model_label}
        )
        return refusals.cut_under_kv_pressure()

    def follow_unseen(self) -> None:
        """Lean profile: the KV budget cannot see tokens stream, so its footprint of this request grows with
        the pool's decode rate instead (called on a tick while the request runs)."""
        admitted = self.admitted
        if admitted is not None and admitted.budget is not None and self.awaiting_report:
            admitted.budget.estimate_progress(admitted.budget_id, self._estimate(admitted))

    def _learn_reported_rate(self, admitted: Admitted, facts: ResponseFacts, timing: ReportedTiming) -> None:
        """A completed stream's usage and timing teach the pool's decode rate, as in the inline profile
        (tokens after the first over the time from the first content event to the last byte), and, where
        the first content event's time is known, the KV budget's pace: without it a lean sidecar never sees
        a request progress, and forecast booking falls back to booking whole lifetimes."""
        seconds = timing.decode_s
        if seconds is None or seconds <= 0 or facts.usage is None or facts.upstream_status != 200:
            return
        if not facts.completed or facts.usage.completion_tokens <= 1:
            return
        sequences = admitted.request.sequences * admitted.request.prompt_count
        tokens = facts.usage.completion_tokens / max(1, sequences) - 1
        self.service.decode_rates.observe(admitted.pool, tokens, seconds)
        if admitted.budget is not None and timing.first_token_after_s is not None:
            admitted.budget.observe_unseen_stream(timing.first_token_after_s, tokens, seconds)
