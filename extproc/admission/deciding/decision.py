"""The admission decision: a request's facts and body in, `Granted | Refusal | Shadowed` out.

    parse ─▶ resolve the model's policy and pool ─▶ check the prompt's lower bound
          ─▶ where the upper bound decides: book the KV, acquire on the bound ─▶ grant (count after)
          ─▶ else count the prompt ─▶ size the reservation ─▶ KV budget check ─▶ book the KV
          ─▶ acquire a lease (or wait in the class's queue) ─▶ grant

Each try is one `Candidate` (candidate.py) over one path, `Decision.admit`: KV check, book, acquire (or
wait: acquiring.py), give back if not admitted, grant. `Decision.run` yields `Hold` before it waits in a
queue, then exactly one outcome, counted once. It calls nothing of the exchange that asked; the exchange
turns the outcome into its phase and verdict. The prompt's exact count is awaited in one place,
`Decision.plan` (`service.count_prompts`), unless the request is admitted on its byte bound (`_on_bound`,
`provisional.py`): the grant then carries the `Correction` that counts it after the verdict.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

from extproc.admission.apis import render_refusal
from extproc.admission.capacity.admitted import Admitted
from extproc.admission.capacity.booking import KvBooking, KvGate
from extproc.admission.capacity.lanes import LaneFull
from extproc.admission.deciding import provisional
from extproc.admission.deciding.acquiring import Acquisition
from extproc.admission.deciding.candidate import Candidate, RequestFacts
from extproc.admission.intake.request import (
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
from extproc.admission.intake.rules import DEFAULT_MODEL, AdmissionRules
from extproc.admission.replies import refusals
from extproc.admission.replies.verdicts import FORWARD, Forward, Hold, Refusal
from extproc.admission.service import AdmissionService
from extproc.admission.vocabulary.errors import AdmissionError
from extproc.admission.vocabulary.names import PRIORITY_HEADER
from extproc.admission.vocabulary.policy import ClassPolicy, ModelPolicy
from extproc.core.limiter import Lease, Rejection

log = logging.getLogger(__name__)

OFF_LOOP_PARSE_BYTES = 64 * 1024
"""A request body larger than this is parsed in a worker thread (with its tokenizing), not on the loop."""


@dataclass(frozen=True, slots=True)
class Granted:
    """Admitted: the lease and its facts, how the request goes upstream (edited body, headers), and, when
    admitted on the prompt's bound, the exact count to follow once the proxy has the verdict."""

    admitted: Admitted
    forward: Forward
    correction: provisional.Correction | None = None  # admitted on the prompt's bound: the count follows


@dataclass(frozen=True, slots=True)
class Shadowed:
    """Shadow mode: enforcement would have refused (`reason`); the request goes on holding no lease."""

    reason: str


def refuse(
    service: AdmissionService,
    api: Api | None,
    refusal: Refusal,
    model_label: str,
    klass: str,
    tenant: str | None,
) -> Refusal:
    """Count and log a refusal, rendered in the error envelope this API's clients parse."""
    refusal = render_refusal(api, refusal)
    service.count("rejected", refusal.reason, model_label, klass, tenant)
    log.info(
        "request refused",
        extra={"status": refusal.status, "reason": refusal.reason, "model": model_label},
    )
    return refusal


class Decision:
    """One request's decision (see the module docstring); `model_label` names it once its model is known."""

    def __init__(self, service: AdmissionService, request: RequestFacts) -> None:
        self.service = service
        self.request = request
        self.model_label = "unknown"
        self.limit_pool = DEFAULT_MODEL  # the pool whose `model:<pool>` limits apply (`resolve`)

    @property
    def tokenizer_lane(self) -> str:
        """Whose share of the tokenizer threads this request uses: its tenant, or its client address."""
        request = self.request
        if request.tenant == self.service.rules().tenant.default and request.client:
            return f"client:{request.client}"
        return f"tenant:{request.tenant}"

    def refuse(self, refusal: Refusal) -> Refusal:
        request = self.request
        return refuse(
            self.service, request.api, refusal, self.model_label, request.klass.name, request.tenant
        )

    def _deny(self, refusal: Refusal, shadow: bool) -> Refusal | Shadowed:
        if not shadow:
            return self.refuse(refusal)
        klass = self.request.klass.name
        self.service.count("shadow_rejected", refusal.reason, self.model_label, klass, self.request.tenant)
        log.info("shadow mode: would refuse", extra={"reason": refusal.reason, "class": klass})
        return Shadowed(refusal.reason)

    async def run(
        self, raw: bytes, rules: AdmissionRules
    ) -> AsyncIterator[Hold | Granted | Refusal | Shadowed]:
        cap = rules.max_body_bytes
        if len(raw) > cap:
            yield self.refuse(refusals.too_large(len(raw), cap))
            return
        try:
            parsed, policy, pool = await self.resolve(raw, rules)
            self.check(parsed, policy, rules)
        except (AdmissionError, LaneFull) as exc:
            yield self._invalid(exc)
            return
        bound = self._on_bound(parsed, policy, pool, rules)
        if bound is not None:
            # No count yet (provisional.py): a bucket or a slot that says no sends it to be counted.
            refused = False
            async for outcome in self.admit(bound, rules):
                if outcome is None:
                    refused = True
                else:
                    yield outcome
            if not refused:
                return
        try:
            plan = await self.plan(parsed, policy, rules)
        except (AdmissionError, LaneFull) as exc:
            yield self._invalid(exc)
            return
        async for outcome in self.admit(Candidate(parsed, policy, pool, plan, self._booking(pool)), rules):
            assert outcome is not None  # only a try on the bound is sent to be counted
            yield outcome

    def _invalid(self, exc: AdmissionError | LaneFull) -> Refusal:
        if isinstance(exc, LaneFull):
            return self.refuse(refusals.tokenizer_busy())
        return self.refuse(refusals.invalid(exc))

    def _on_bound(
        self, parsed: ParsedRequest, policy: ModelPolicy, pool: str, rules: AdmissionRules
    ) -> Candidate | None:
        """The try on the prompt's upper bound where it decides (`provisional.py`), else None: the request
        must be counted first (near the window, when the bound does not fit the KV budget, when it must
        queue)."""
        bound = provisional.bound_plan(parsed, policy, rules.per_step)
        if bound is None:
            return None
        candidate = Candidate(parsed, policy, pool, bound, self._booking(pool), on_bound=True)
        klass = self.request.klass
        if not provisional.may_admit_on_bound(self.service, klass, candidate, self.tokenizer_lane):
            return None
        return candidate

    async def admit(
        self, candidate: Candidate, rules: AdmissionRules
    ) -> AsyncIterator[Hold | Granted | Refusal | Shadowed | None]:
        """Try `candidate`: check the KV budget, book, acquire a lease (or wait in the class's queue), give
        the booking back if not admitted, grant. Yields `Hold` before it waits, then one outcome; None for a
        try on the bound that a bucket or a slot refused (count it, and try the exact need)."""
        klass, service = self.request.klass, self.service
        shadow = rules.shadow or klass.shadow
        booking = candidate.booking
        # A try on the bound was checked against the budget already, without claiming (`_on_bound`).
        fits, headroom = (True, None) if candidate.on_bound else candidate.fits(service.clock())
        acquisition = Acquisition(service, self.request, self.limit_pool)
        waits = acquisition.may_wait(shadow) and not candidate.on_bound
        if not fits and not waits:
            yield self._deny(self._kv_refusal(candidate, headroom), shadow)
            return
        # Only a request that may wait holds a place in the deadlines' layout of its queue.
        run_s = self._run_seconds(candidate) if waits else 0.0
        # The KV is booked before each of the limiter's awaits, so that concurrent decisions see each
        # other's, and never while the request waits in a queue: there it is booked the moment it fits.
        # The waiter holds the request without its body (a waiter must not hold megabytes of JSON).
        gate = KvGate(booking, replace(candidate.parsed, body={}), candidate.plan, fits)
        result: Lease | Rejection | Refusal | None = None
        try:
            async for step in acquisition.run(gate, waits, run_s):
                if isinstance(step, Hold):
                    yield step
                else:
                    result = step
        finally:
            if not isinstance(result, Lease):
                booking.give_back()  # refused, or the caller went away while it waited
        if isinstance(result, Lease):
            yield self._grant(result, candidate, rules)
        elif isinstance(result, Rejection):
            if candidate.on_bound:
                yield None
                return
            refusal = refusals.rate_limited(
                service.retry_hint(result), candidate.parsed.model, gate.plan.total
            )
            yield self._deny(refusal, shadow)
        else:
            assert result is not None
            if not fits and result.reason == "queue_timeout":
                # Waited its whole bound for KV: the budget's forecast says when to try again.
                result = self._kv_refusal(candidate, gate.booking.fits(gate.request, gate.plan)[1])
            yield self.refuse(result)

    def _booking(self, pool: str) -> KvBooking:
        deps, request = self.service.deps, self.request
        rank = self.service.rules().rank_of(request.klass)
        return KvBooking(deps.kv_budget(pool), pool, request.tenant, deps.budget_changed, deps.clock, rank)

    def _forwarding(
        self, parsed: ParsedRequest, plan: Reservation, rules: AdmissionRules
    ) -> tuple[ParsedRequest, bytes | None, bool]:
        """The admission facts kept (not the parsed body: a waiting request must not hold megabytes of
        JSON), the edited body (None: unchanged), and whether to strip a usage event the client did not
        ask for."""
        edits = BodyEdits(
            include_usage=rules.inject_include_usage,
            max_tokens=plan.injected_max_tokens,
            strip_priority=True,
            priority=self.request.klass.backend_priority,
        )
        new_body = edit_body(parsed, edits)
        strip_usage = (
            edits.include_usage
            and parsed.stream
            and not parsed.include_usage
            and parsed.api in USAGE_OPTION_APIS
        )
        return replace(parsed, body={}), new_body, strip_usage

    def _grant(self, lease: Lease, candidate: Candidate, rules: AdmissionRules) -> Granted:
        """The admission, counted once, and how the request goes upstream; on the bound, with the exact count
        to follow."""
        klass, tenant, service = self.request.klass, self.request.tenant, self.service
        facts, new_body, strip_usage = self._forwarding(candidate.parsed, candidate.plan, rules)
        admitted = Admitted(
            lease=lease,
            request=facts,
            policy=candidate.policy,
            pool=candidate.pool,
            plan=candidate.plan,
            tenant=tenant,
            klass=klass,
            model_label=self.model_label,
            booking=candidate.booking,
            strip_usage=strip_usage,
            admitted_at=service.clock(),
        )
        service.count("admitted", "ok", self.model_label, klass.name, tenant)
        service.child(service.metrics.tokens_reserved, self.model_label).inc(candidate.plan.total)
        service.metrics.active.inc()
        correction = provisional.Correction(service, self.tokenizer_lane) if candidate.on_bound else None
        return Granted(admitted, self._forward(klass, new_body), correction)

    @staticmethod
    def _forward(klass: ClassPolicy, new_body: bytes | None) -> Forward:
        headers: tuple[tuple[str, str], ...] = ()
        if klass.backend_priority is not None:
            # vLLM reads the header on every API (the Messages API has no body field for it).
            headers = ((PRIORITY_HEADER, str(klass.backend_priority)),)
        if new_body is None:
            return Forward(set_headers=headers) if headers else FORWARD
        return Forward(set_headers=(*headers, ("content-length", str(len(new_body)))), body=new_body)

    async def resolve(self, raw: bytes, rules: AdmissionRules) -> tuple[ParsedRequest, ModelPolicy, str]:
        """Parse, and resolve the requested model to its policy and pool (404 for one nobody serves)."""
        api = self.request.api
        stored = rules.allow_stored_context
        bounds = rules.per_step
        if len(raw) > OFF_LOOP_PARSE_BYTES:
            # A large body can hold tens of thousands of small messages: parsing it takes tens of ms, on a
            # worker thread, through the client's lane like its counting.
            parse = functools.partial(parse_request, allow_stored_context=stored, bounds=bounds)
            parsed = await self.service.lanes.run(self.tokenizer_lane, parse, api, raw)
        else:
            parsed = parse_request(api, raw, allow_stored_context=stored, bounds=bounds)
        served_as = self.service.deps.served_as(parsed.model, rules)
        policy = rules.model_policy(served_as) if served_as is not None else None
        if served_as is None or policy is None:
            raise AdmissionError(
                404, f"The model `{parsed.model}` does not exist.", code="model_not_found", param="model"
            )
        self.limit_pool = rules.pool_of(served_as)
        self.model_label = rules.model_label(self.limit_pool)
        return parsed, policy, self._engine_pool(served_as)

    def _engine_pool(self, served_as: str) -> str:
        """The pool whose engines serve the request: its KV budget, KV usage and decode pace. The limits'
        pool, except for a name the config does not know, which shares the `models."*"` limits (a client
        must not mint limits by inventing names) but whose engines the feed reports by that name: their
        budget applies to it (else a config that names no model would run without any KV budget)."""
        if self.limit_pool == DEFAULT_MODEL and self.service.deps.feeds_pool(served_as):
            return served_as
        return self.limit_pool

    def check(self, parsed: ParsedRequest, policy: ModelPolicy, rules: AdmissionRules) -> None:
        """Refuse what needs no count: a request-supplied chat template, a prompt whose cheap lower bound
        is already past the context window."""
        self._check_template(parsed, rules)
        lower = prompt_token_lower_bound(parsed, policy)
        if lower >= policy.context_window + (0 if parsed.generates else 1):
            raise AdmissionError(
                400,
                f"This model's maximum context length is {policy.context_window} tokens. However, your "
                f"request has at least {lower} input tokens. Please reduce the length of the input.",
                code="context_length_exceeded",
                param=parsed.prompt_param,
            )

    async def plan(self, parsed: ParsedRequest, policy: ModelPolicy, rules: AdmissionRules) -> Reservation:
        """Await the prompt's exact count, and size the reservation from it."""
        service = self.service
        started = service.clock()
        counts = await service.count_prompts(parsed, policy, self.tokenizer_lane)
        service.metrics.tokenize_seconds.observe(service.clock() - started)
        return plan_reservation(parsed, counts, policy, rules.per_step)

    @staticmethod
    def _check_template(parsed: ParsedRequest, rules: AdmissionRules) -> None:
        """A request-supplied chat template can expand a small body into a huge prompt: refuse it unless the
        operator trusts clients with it (`admission.allow_request_chat_template`)."""
        if rules.allow_request_chat_template:
            return
        key = parsed.custom_template
        if key is not None:
            raise AdmissionError(
                400,
                f"'{key}' is not accepted by this gateway; the server's own chat template is used.",
                code="unsupported_parameter",
                param=key,
            )

    def _run_seconds(self, candidate: Candidate) -> float:
        """How long this request is expected to hold its slot: its expected completion per sequence at the
        pool's decode rate, as an open lease's remaining time is reckoned (`InFlight.open_lease`)."""
        parsed = candidate.parsed
        allowance = candidate.plan.completion_tokens / max(1, parsed.sequences * parsed.prompt_count)
        return candidate.booking.expected_completion(allowance) / self.service.decode_rates.rate(
            candidate.pool
        )

    def _kv_refusal(self, candidate: Candidate, headroom: int | None) -> Refusal:
        budget = candidate.booking.budget
        assert budget is not None
        wait = refusals.kv_retry_after(budget, self.service.clock())
        return refusals.kv_budget(candidate.parsed.model, candidate.plan.total, headroom or 0, wait)
