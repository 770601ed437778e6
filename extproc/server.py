"""The ext_proc servicer: one `StreamHandler` per Envoy stream, which is one HTTP request.

Envoy sends request headers, the BUFFERED request body, response headers and STREAMED response body chunks.
Admission happens on the request body: validate, count prompt tokens (in a worker thread, so other streams
keep flowing), check the context window, then take slots and tokens from the store, or answer the client
directly with an OpenAI-style error. The response side watches usage so the lease settles to what the
backend really produced.

However the stream ends (end of response, client disconnect, upstream reset, Envoy's message timeout,
sidecar shutdown) the handler's `finish` runs from the generator's `finally`, with a gRPC done-callback as a
backstop, and the lease settles exactly once. Whether a response is complete is decided only by seeing
`end_of_stream` on the response, never by how the RPC ended: Envoy ends every RPC the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import re
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Executor
from dataclasses import dataclass, replace
from typing import Any

from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf.duration_pb2 import Duration

from extproc import responses as r
from extproc.admission.errors import AdmissionError, error_body
from extproc.admission.request import (
    Endpoint,
    ModelPolicy,
    ParsedRequest,
    Reservation,
    count_prompt_tokens,
    endpoint_for,
    parse_request,
    plan_reservation,
    prompt_token_lower_bound,
    with_include_usage,
)
from extproc.admission.usage import ResponseUsageTracker
from extproc.config import ClassConfig, Config
from extproc.core.clock import Clock, monotonic
from extproc.core.kv_budget import KvBudget
from extproc.core.limiter import Lease, Reason, Rejection
from extproc.core.ports import LimiterStore, StoreUnavailable
from extproc.metrics import Metrics
from extproc.queueing import WAITABLE, AdmissionQueue, QueueFull

log = logging.getLogger(__name__)

_BACKGROUND: set[asyncio.Future[Any]] = set()
"""Strong references to fire-and-forget settlements, so the event loop cannot drop them mid-flight."""

OFF_LOOP_PARSE_BYTES = 64 * 1024
"""A request body larger than this is parsed in a worker thread (with its tokenizing), not on the loop."""

OFF_LOOP_FINISH_BYTES = 64 * 1024
"""A buffered response body larger than this is settled in a worker thread, not on the event loop."""

KV_RETRY_AFTER_S = 1.0
"""Retry hint for a KV-budget refusal: running sequences finish and free blocks continuously."""

_TENANT_RE = re.compile(r"[A-Za-z0-9._:@/-]{1,128}")


@dataclass
class Deps:
    """What every stream needs; `config` is read per request so a reload applies to new requests only."""

    config: Callable[[], Config]
    store: LimiterStore
    metrics: Metrics
    executor: Executor | None = None
    clock: Clock = monotonic
    kv_budget: Callable[[str], KvBudget | None] = lambda _pool: None
    budget_changed: Callable[[str], None] = lambda _pool: None
    kv_usage: Callable[[str], float | None] = lambda _pool: None
    queue: AdmissionQueue | None = None


def _headers(message: pb.HttpHeaders) -> dict[str, str]:
    out: dict[str, str] = {}
    for h in message.headers.headers:
        raw = h.raw_value if h.raw_value else h.value.encode("utf-8")
        out[h.key.lower()] = raw.decode("utf-8", "replace")
    return out


@dataclass(eq=False)
class StreamHandler:
    deps: Deps
    endpoint: Endpoint | None = None
    tenant: str = "default"
    klass: ClassConfig | None = None
    model_label: str = "unknown"
    decided: bool = False
    settling: bool = False
    rpc_done: bool = False
    on_late_lease: Callable[[StreamHandler], None] | None = None
    parsed: ParsedRequest | None = None
    policy: ModelPolicy | None = None
    plan: Reservation | None = None
    lease: Lease | None = None
    budget: KvBudget | None = None
    strip_usage: bool = False
    tracker: ResponseUsageTracker | None = None
    upstream_status: int | None = None
    completed: bool = False
    closed: bool = False
    cut: bool = False

    # -- dispatch ------------------------------------------------------------------------------------------

    async def handle(self, request: pb.ProcessingRequest) -> AsyncIterator[pb.ProcessingResponse]:
        """The replies to one message: normally one; a waiting request first extends Envoy's timer."""
        kind = request.WhichOneof("request")
        if kind == "request_headers":
            yield self._on_request_headers(request)
        elif kind == "request_body":
            async for response in self._on_request_body(request.request_body):
                yield response
        elif kind == "response_headers":
            yield self._on_response_headers(request.response_headers)
        elif kind == "response_body":
            yield await self._on_response_body(request.response_body)
        elif kind == "request_trailers":
            yield r.continue_trailers(response=False)
        elif kind == "response_trailers":
            self.completed = True
            yield r.continue_trailers(response=True)
        else:
            raise ValueError(f"unexpected ext_proc message {kind!r}")

    @property
    def class_name(self) -> str:
        return self.klass.name if self.klass is not None else "none"

    def _count(self, decision: str, reason: str) -> None:
        metrics = self.deps.metrics
        metrics.requests.labels(decision, reason, self.model_label, self.class_name).inc()
        metrics.tenant_requests.labels(self.deps.config().tenant_label(self.tenant), decision).inc()

    # -- request -------------------------------------------------------------------------------------------

    def _on_request_headers(self, request: pb.ProcessingRequest) -> pb.ProcessingResponse:
        message = request.request_headers
        if request.HasField("protocol_config"):
            _check_body_mode(request.protocol_config.request_body_mode)
        headers = _headers(message)
        config = self.deps.config()
        self.endpoint = endpoint_for(headers.get(":method", ""), headers.get(":path", ""))
        if self.endpoint is None:
            self.deps.metrics.requests.labels("passthrough", "not_admitted_endpoint", "none", "none").inc()
            return r.continue_request_headers(passthrough=True)
        claimed = _tenant(request, headers, config)
        self.tenant = claimed if _TENANT_RE.fullmatch(claimed) else config.admission.tenant.default
        self.klass = config.class_of(self.tenant)
        if message.end_of_stream:
            return self._refuse(
                AdmissionError(
                    400,
                    "The request body is empty; a JSON object is required.",
                    code="invalid_json",
                    param=None,
                )
            )
        length = headers.get("content-length")
        cap = config.admission.max_body_bytes
        if length is not None and length.isascii() and length.isdigit() and int(length) > cap:
            return self._refuse(_too_large(int(length), cap))
        return r.continue_request_headers()

    async def _on_request_body(self, message: pb.HttpBody) -> AsyncIterator[pb.ProcessingResponse]:
        if self.endpoint is None or self.decided:
            yield r.continue_request_body()
            return
        # BUFFERED mode delivers the whole body in this one message. When trailers follow (HTTP/2, gRPC-web)
        # it comes with end_of_stream unset; waiting for more would let the request upstream unadmitted.
        self.decided = True
        config = self.deps.config()
        if len(message.body) > config.admission.max_body_bytes:
            yield self._refuse(_too_large(len(message.body), config.admission.max_body_bytes))
            return
        started = self.deps.clock()
        try:
            plan = await self._plan(message.body, config)
        except AdmissionError as exc:
            yield self._refuse(exc)
            return
        assert self.parsed is not None and self.klass is not None
        klass = self.klass
        shadow = config.shadow or klass.shadow
        budget = self.deps.kv_budget(self.parsed.model)
        if budget is not None:
            fits, headroom = budget.would_fit(plan.prompt_tokens, plan.completion_tokens)
            if not fits:
                self.deps.metrics.decision_seconds.observe(self.deps.clock() - started)
                if shadow:
                    yield self._shadow_pass("kv_budget")
                else:
                    yield self._kv_rejected(plan, headroom or 0)
                return
        new_body = with_include_usage(self.parsed) if config.admission.inject_include_usage else None
        # Keep the admission facts, not the parsed body: a waiting request must not hold megabytes of JSON.
        self.parsed = replace(self.parsed, body={})
        keys = ["global", f"model:{self.parsed.model}", f"tenant:{self.tenant}"]
        queue = self.deps.queue
        waits = queue is not None and klass.queues and not shadow
        behind = queue is not None and queue.must_queue(klass.name)
        result: Lease | Rejection | None = None
        try:
            if not (behind and waits):
                # Waiters of a higher class are ahead: a class that does not queue may still use its own
                # guarantee, but not the pool they are waiting for.
                result = await self._acquire(keys, plan.total, use_pool=not behind)
            if waits and (result is None or (isinstance(result, Rejection) and result.reason in WAITABLE)):
                assert queue is not None
                # Envoy's per-message timer must not fire while the request waits for capacity.
                yield pb.ProcessingResponse(
                    override_message_timeout=Duration(seconds=math.ceil(klass.max_wait_seconds) + 1)
                )
                try:
                    result = await queue.wait(
                        keys, plan.total, klass.name, self.tenant, klass.max_wait_seconds
                    )
                except QueueFull:
                    yield self._queue_refused("queue_full", plan)
                    return
                if result is None:
                    yield self._queue_refused("queue_timeout", plan)
                    return
        except StoreUnavailable:
            yield self._store_unavailable()
            return
        self.deps.metrics.decision_seconds.observe(self.deps.clock() - started)
        assert result is not None
        if isinstance(result, Rejection):
            yield self._shadow_pass(result.reason.value) if shadow else self._rate_limited(result, plan)
            return
        self.lease = result
        self.plan = plan
        if budget is not None:
            budget.admit(self._budget_id(), plan.prompt_tokens, plan.completion_tokens)
            self.budget = budget
            self.deps.budget_changed(self.parsed.model)
        metrics = self.deps.metrics
        self._count("admitted", "ok")
        metrics.tokens_reserved.labels(self.model_label).inc(plan.total)
        metrics.active.inc()
        if self.rpc_done and self.on_late_lease is not None:
            # The RPC ended while we waited (a cancel that the wait swallowed): settle now, not at GC.
            self.on_late_lease(self)
        if new_body is None:
            yield r.continue_request_body()
            return
        self.strip_usage = True
        yield r.continue_request_body(set_headers=[("content-length", str(len(new_body)))], body=new_body)

    def _store_unavailable(self) -> pb.ProcessingResponse:
        """The shared limiter store is down and configured to fail closed (`store.on_unavailable: reject`)."""
        self.closed = True
        self._count("rejected", "store_unavailable")
        body = error_body(
            "The gateway cannot check its rate limits right now. Please try again shortly.",
            type="server_error",
            code="service_unavailable",
        )
        headers = [*r.retry_headers(1.0), ("x-extproc-reject-reason", "store_unavailable")]
        return r.immediate(503, body, headers, details="extproc_store_unavailable")

    def _shadow_pass(self, reason: str) -> pb.ProcessingResponse:
        """Shadow mode: count and log what enforcement would have refused, then let it through.

        The request holds no lease, so the limiter keeps evolving exactly as it would under enforcement.
        """
        self._count("shadow_rejected", reason)
        log.info("shadow mode: would refuse", extra={"reason": reason, "class": self.class_name})
        return r.continue_request_body()

    def _queue_refused(self, reason: str, plan: Reservation) -> pb.ProcessingResponse:
        self.closed = True
        assert self.klass is not None
        self._count("rejected", reason)
        wait = self.klass.max_wait_seconds
        message = (
            f"No capacity for class {self.klass.name} within {wait:g}s "
            f"({'the wait queue is full' if reason == 'queue_full' else 'waited until the deadline'}). "
            "Please try again later."
        )
        headers = [*r.retry_headers(max(1.0, wait / 2)), ("x-extproc-reject-reason", reason)]
        log.info("request not admitted from the queue", extra={"reason": reason, "tokens": plan.total})
        body = error_body(message, type="requests", code="rate_limit_exceeded")
        return r.immediate(429, body, headers, details=f"extproc_rate_limited_{reason}")

    async def _plan(self, raw: bytes, config: Config) -> Reservation:
        assert self.endpoint is not None
        loop = asyncio.get_running_loop()
        if len(raw) > OFF_LOOP_PARSE_BYTES:
            # A large body can hold tens of thousands of small messages: parsing it takes tens of ms.
            parsed = await loop.run_in_executor(self.deps.executor, parse_request, self.endpoint, raw)
        else:
            parsed = parse_request(self.endpoint, raw)
        policy = config.model_policy(parsed.model)
        self.model_label = parsed.model if parsed.model in config.models else "other"
        if policy is None:
            raise AdmissionError(
                404, f"The model `{parsed.model}` does not exist.", code="model_not_found", param="model"
            )
        self.parsed, self.policy = parsed, policy
        if parsed.prompt_count == 1:
            lower = prompt_token_lower_bound(parsed, policy.encoding)
            if lower >= policy.context_window:
                raise AdmissionError(
                    400,
                    f"This model's maximum context length is {policy.context_window} tokens. However, your "
                    f"request has at least {lower} input tokens. Please reduce the length of the input.",
                    code="context_length_exceeded",
                    param="messages" if parsed.endpoint is Endpoint.CHAT else "prompt",
                )
        t0 = self.deps.clock()
        counts = await loop.run_in_executor(self.deps.executor, count_prompt_tokens, parsed, policy.encoding)
        self.deps.metrics.tokenize_seconds.observe(self.deps.clock() - t0)
        return plan_reservation(parsed, counts, policy)

    async def _acquire(self, keys: list[str], tokens: int, use_pool: bool = True) -> Lease | Rejection:
        """Acquire so that a lease granted while this stream is being cancelled is given back, not leaked."""
        holder = self.klass.name if self.klass is not None else None
        future = asyncio.ensure_future(self.deps.store.acquire(keys, tokens, holder, use_pool=use_pool))
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            store, pending = self.deps.store, _BACKGROUND

            def give_back(done: asyncio.Future[Lease | Rejection]) -> None:
                if done.cancelled() or done.exception() is not None:
                    return
                lease = done.result()
                if isinstance(lease, Lease):
                    task = asyncio.ensure_future(store.release(lease, 0))
                    pending.add(task)
                    task.add_done_callback(pending.discard)

            future.add_done_callback(give_back)
            raise

    def _refuse(self, exc: AdmissionError) -> pb.ProcessingResponse:
        self.closed = True
        self._count("rejected", exc.code or f"http_{exc.status}")
        log.info(
            "request refused",
            extra={"status": exc.status, "code": exc.code, "param": exc.param, "model": self.model_label},
        )
        return r.immediate(exc.status, exc.body(), details=f"extproc_{exc.code or exc.status}")

    def _budget_id(self) -> str:
        assert self.lease is not None
        return str(self.lease.lease_id)

    def _kv_rejected(self, plan: Reservation, headroom: int) -> pb.ProcessingResponse:
        """The pool's KV cache cannot take this request's footprint now; sequences finishing will free it."""
        self.closed = True
        assert self.parsed is not None
        self._count("rejected", "kv_budget")
        message = (
            f"The KV cache of {self.parsed.model} is at its admission target: this request needs up to "
            f"{plan.total} tokens of KV cache and {max(0, headroom)} are available. Please try again shortly."
        )
        headers = [*r.retry_headers(KV_RETRY_AFTER_S), ("x-extproc-reject-reason", "kv_budget")]
        log.info("request refused by kv budget", extra={"tokens": plan.total, "headroom": headroom})
        body = error_body(message, type="tokens", code="rate_limit_exceeded")
        return r.immediate(429, body, headers, details="extproc_rate_limited_kv_budget")

    def _rate_limited(self, rej: Rejection, plan: Reservation) -> pb.ProcessingResponse:
        self.closed = True
        assert self.parsed is not None
        self._count("rejected", rej.reason.value)
        status = rej.status
        if rej.reason is Reason.CONCURRENCY:
            kind = "requests"
            message = (
                f"Rate limit reached for {self.parsed.model} on concurrent requests ({rej.key}): "
                f"Limit {status.limit_requests}. "
                f"Please try again in {r.format_duration(rej.retry_after_s or 0)}."
            )
        elif rej.reason is Reason.TOKENS:
            kind = "tokens"
            message = (
                f"Rate limit reached for {self.parsed.model} on tokens per min (TPM) ({rej.key}): "
                f"Limit {status.limit_tokens}, Remaining {status.remaining_tokens}, Requested {plan.total}. "
                f"Please try again in {r.format_duration(rej.retry_after_s or 0)}."
            )
        else:
            kind = "tokens"
            message = (
                f"Request too large for {self.parsed.model} on tokens per min (TPM) ({rej.key}): "
                f"Limit {status.limit_tokens}, Requested {plan.total}. "
                "Reduce the prompt or max_tokens; retrying cannot succeed."
            )
        headers = [
            *r.retry_headers(rej.retry_after_s),
            *r.ratelimit_headers(status),
            ("x-extproc-reject-reason", rej.reason.value),
        ]
        log.info(
            "request rate limited",
            extra={
                "reason": rej.reason.value,
                "key": rej.key,
                "tokens": plan.total,
                "model": self.model_label,
            },
        )
        body = error_body(message, type=kind, code="rate_limit_exceeded")
        return r.immediate(429, body, headers, details=f"extproc_rate_limited_{rej.reason.value}")

    # -- response ------------------------------------------------------------------------------------------

    def _on_response_headers(self, message: pb.HttpHeaders) -> pb.ProcessingResponse:
        if self.lease is None:
            return r.continue_response_headers()
        headers = _headers(message)
        status = headers.get(":status", "")
        self.upstream_status = int(status) if status.isdigit() else None
        streaming = "text/event-stream" in headers.get("content-type", "")
        ok = self.upstream_status is not None and self.upstream_status < 400
        assert self.policy is not None
        self.tracker = ResponseUsageTracker(
            streaming=streaming,
            encoding=self.policy.encoding,
            strip_usage_chunk=self.strip_usage and streaming and ok,
        )
        if message.end_of_stream:
            self.completed = True
        return r.continue_response_headers(r.ratelimit_headers(self.lease.status))

    async def _on_response_body(self, message: pb.HttpBody) -> pb.ProcessingResponse:
        tracker = self.tracker
        if tracker is None:
            return r.continue_response_body()
        if self._should_cut() and not message.end_of_stream:
            return self._cut_stream()
        out = tracker.feed(message.body)
        if self.budget is not None:
            self.budget.progress(self._budget_id(), tracker.usage.completion_tokens)
        if message.end_of_stream:
            if tracker.buffered_bytes > OFF_LOOP_FINISH_BYTES:
                # A large JSON answer without usage is parsed and tokenized: keep other streams flowing.
                tail = await asyncio.get_running_loop().run_in_executor(self.deps.executor, tracker.finish)
            else:
                tail = tracker.finish()
            if tail is not None:
                out = (message.body if out is None else out) + tail
            self.completed = True
        return r.continue_response_body(out)

    def _should_cut(self) -> bool:
        klass, parsed = self.klass, self.parsed
        if klass is None or klass.cut_streams_above_kv is None or parsed is None:
            return False
        usage = self.deps.kv_usage(parsed.model)
        return usage is not None and usage > klass.cut_streams_above_kv

    def _cut_stream(self) -> pb.ProcessingResponse:
        """Reset this stream: Envoy drops the chunk, resets client and upstream, and the backend frees the
        sequence's KV blocks. Settles as an abort (prompt + what was streamed)."""
        self.cut = True
        self.closed = True
        self.deps.metrics.streams_cut.labels(self.class_name).inc()
        log.warning(
            "stream cut under KV pressure", extra={"class": self.class_name, "model": self.model_label}
        )
        body = error_body(
            "The request was stopped to relieve KV-cache pressure; lower-priority work is shed first.",
            type="server_error",
            code="overloaded",
        )
        return r.immediate(503, body, details="extproc_cut_under_kv_pressure")

    # -- settlement ----------------------------------------------------------------------------------------

    def settlement(self) -> tuple[int, str, int, int]:
        """(actual tokens, outcome, prompt, completion) under the rules in docs/admission.md."""
        assert self.plan is not None
        prompt = self.plan.prompt_tokens
        completion = 0
        usage = self.tracker.usage if self.tracker is not None else None
        if usage is not None:
            if usage.reported and usage.prompt_tokens is not None:
                prompt = usage.prompt_tokens
            completion = usage.completion_tokens
        upstream_error = (self.upstream_status is not None and self.upstream_status >= 400) or (
            self.tracker is not None and self.tracker.error_seen
        )
        if self.cut:
            outcome = "cut"
        elif upstream_error:
            outcome = "upstream_error"
        elif self.completed:
            outcome = "completed"
        else:
            outcome = "aborted"
        return prompt + completion, outcome, prompt, completion

    def finish(self) -> asyncio.Future[bool] | None:
        """Settle the lease if this stream holds one; safe to call any number of times."""
        lease = self.lease
        if lease is None or self.settling or lease.settled:
            return None
        # Book the settlement on this stream's first attempt, whatever the store answers: a shared store
        # answers False for a lease that already expired there, and the request still ended here.
        self.settling = True
        actual, outcome, prompt, completion = self.settlement()
        if self.budget is not None and self.parsed is not None:
            self.budget.release(self._budget_id(), completion if outcome == "completed" else None)
            self.deps.budget_changed(self.parsed.model)
        metrics = self.deps.metrics
        future = asyncio.ensure_future(self.deps.store.release(lease, actual))
        lease_model = self.model_label

        queue = self.deps.queue

        def account(done: asyncio.Future[bool]) -> None:
            if done.cancelled() or done.exception() is not None:
                log.error("lease settlement failed", extra={"model": lease_model})
                return
            if queue is not None:
                queue.kick()
            metrics.active.dec()
            metrics.settlements.labels(outcome).inc()
            metrics.tokens_settled.labels(lease_model, "prompt").inc(prompt)
            metrics.tokens_settled.labels(lease_model, "completion").inc(completion)
            delta = lease.reserved_tokens - actual
            if delta > 0:
                metrics.tokens_refunded.labels(lease_model).inc(delta)
            elif delta < 0:
                metrics.tokens_overrun.labels(lease_model).inc(-delta)
            log.debug(
                "lease settled",
                extra={
                    "outcome": outcome,
                    "reserved": lease.reserved_tokens,
                    "actual": actual,
                    "model": lease_model,
                },
            )

        future.add_done_callback(account)
        return future


class ExtProcServicer(pb_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    def __init__(self, deps: Deps) -> None:
        self.deps = deps
        self._pending: set[asyncio.Future[bool]] = set()
        self._open: set[StreamHandler] = set()

    def _finish(self, stream: StreamHandler) -> None:
        future = stream.finish()
        if future is not None:
            self._pending.add(future)
            future.add_done_callback(self._pending.discard)

    async def Process(
        self, request_iterator: AsyncIterator[pb.ProcessingRequest], context: Any
    ) -> AsyncIterator[pb.ProcessingResponse]:
        stream = StreamHandler(self.deps, on_late_lease=self._finish)
        self._open.add(stream)
        self.deps.metrics.streams.inc()

        def done(_ctx: Any) -> None:
            stream.rpc_done = True
            self._finish(stream)

        context.add_done_callback(done)
        try:
            async for request in request_iterator:
                async for response in stream.handle(request):
                    yield response
                if stream.closed:
                    break
        finally:
            self._open.discard(stream)
            self.deps.metrics.streams.dec()
            self._finish(stream)

    def settle_open_streams(self) -> None:
        """On shutdown after the grace period: settle what is still open with what is known."""
        for stream in list(self._open):
            self._finish(stream)

    async def drain(self) -> None:
        """Wait for settlements already started, so shutdown never drops a refund."""
        while self._pending:
            with contextlib.suppress(Exception):
                await asyncio.gather(*list(self._pending), return_exceptions=True)


_MODE = processing_mode_pb2.ProcessingMode
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


def _tenant(request: pb.ProcessingRequest, headers: dict[str, str], config: Config) -> str:
    """The tenant from the configured trusted source: a header set by an earlier filter, or Envoy metadata."""
    source = config.admission.tenant
    if source.metadata_namespace:
        namespace = request.metadata_context.filter_metadata.get(source.metadata_namespace)
        if namespace is not None:
            value = namespace.fields.get(source.metadata_key)
            if value is not None and value.WhichOneof("kind") == "string_value":
                return str(value.string_value)
    if source.header:
        return headers.get(source.header, "")
    return ""


def _too_large(size: int, cap: int) -> AdmissionError:
    return AdmissionError(
        413,
        f"Request body of {size} bytes exceeds the limit of {cap} bytes.",
        code="request_too_large",
        param=None,
    )
