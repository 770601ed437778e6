"""The admission decision: a request's facts and body in, `Granted | Refusal | Shadowed` out.

    resolve (resolving.py: parse, the model's policy and pools, refuse what needs no count)
          ─▶ refuse a pool whose engines the feed shows all unreachable (503 engine_down)
          ─▶ where the upper bound decides: book the KV, acquire on the bound ─▶ grant (count after)
          ─▶ else count the prompt ─▶ size the reservation ─▶ KV budget check ─▶ book the KV
          ─▶ acquire a lease (or wait in the class's queue) ─▶ grant

Each try is one `Candidate` (candidate.py) over one path, `Decision.admit`: KV check, book, acquire (or
wait: acquiring.py), give back if not admitted, grant (`Candidate.grant`). `Decision.run` yields `Hold`
before it waits in a queue, then exactly one outcome, counted once. It calls nothing of the exchange that
asked; the exchange turns the outcome into its phase and verdict. The rules are read once per decision, by
the exchange, and every step reads those. The prompt's exact count is awaited in one place, in
`Decision.run` (`service.count_prompts`), unless the request is admitted on its byte bound
(`provisional.on_bound`): the grant then carries the `Correction` that counts it after the verdict. The
decision calls out for each step and keeps few steps of its own, so that following a request through it
means reading one function, not returning to it after every call."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

from extproc.admission.apis import render_refusal
from extproc.admission.capacity.admitted import Admitted
from extproc.admission.capacity.booking import KvBooking, KvGate
from extproc.admission.capacity.lanes import LaneFull
from extproc.admission.deciding import provisional, resolving
from extproc.admission.deciding.acquiring import Acquisition
from extproc.admission.deciding.candidate import Candidate, RequestFacts
from extproc.admission.intake.request import Api
from extproc.admission.intake.reservation import plan_reservation
from extproc.admission.intake.rules import DEFAULT_MODEL, AdmissionRules
from extproc.admission.replies import refusals
from extproc.admission.replies.verdicts import Forward, Hold, Refusal
from extproc.admission.service import AdmissionService
from extproc.admission.vocabulary.errors import AdmissionError
from extproc.core.limiter.limiter import Lease, Rejection

log = logging.getLogger(__name__)


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
        self.limit_pool = DEFAULT_MODEL  # the pool whose `model:<pool>` limits apply (`resolving.resolve`)
        self.tokenizer_lane = ""  # whose share of the tokenizer threads it uses (`run`, from its rules)

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
        """Decide on `raw` under `rules`, read once by the caller and passed to every step (the resolution,
        the try on the bound, the count, each try's keys and queue bounds, the grant): a reload while the
        request is decided never mixes two configs in one decision."""
        cap = rules.max_body_bytes
        if len(raw) > cap:
            yield self.refuse(refusals.too_large(len(raw), cap))
            return
        request, service = self.request, self.service
        # Its share of the tokenizer threads: its tenant's, or, under the default tenant, its client's.
        default = request.tenant == rules.tenant.default and request.client
        lane = self.tokenizer_lane = f"client:{request.client}" if default else f"tenant:{request.tenant}"
        try:
            resolved = await resolving.resolve(
                service, request.api, raw, rules, lane, request.content_type, request.endpoint
            )
            self.limit_pool, self.model_label = resolved.limit_pool, resolved.model_label
            resolving.check(resolved, rules)
        except (AdmissionError, LaneFull) as exc:
            yield await self._invalid(exc, rules, resolved=False)
            return
        deps, pool, parsed, policy = service.deps, resolved.pool, resolved.parsed, resolved.policy
        down_for = deps.engine_down_for(pool)
        if down_for is not None:
            # No engine of the pool accepts connections (the KV feed says so): nothing is counted or held.
            refusal = refusals.engine_down(parsed.model, refusals.engine_down_retry_after(down_for))
            yield self._deny(refusal, rules.shadow or request.klass.shadow)
            return
        rank = rules.rank_of(request.klass)
        booking = KvBooking(
            resolved.budget,
            resolved.budget_key,
            request.tenant,
            deps.budget_changed,
            deps.clock,
            rank,
            in_order=policy.template.in_order,
        )
        bound = provisional.on_bound(service, request.klass, resolved, booking, rules, lane)
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
            # The prompt's exact count, awaited here and only here, and the reservation sized from it.
            started = service.clock()
            counts = await service.count_prompts(parsed, policy, lane)
            service.metrics.tokenize_seconds.observe(service.clock() - started)
            plan = plan_reservation(parsed, counts, policy, rules.per_step)
        except (AdmissionError, LaneFull) as exc:
            yield await self._invalid(exc, rules, resolved=True)
            return
        async for outcome in self.admit(Candidate(parsed, policy, pool, plan, booking), rules):
            assert outcome is not None  # only a try on the bound is sent to be counted
            yield outcome

    async def _invalid(
        self, exc: AdmissionError | LaneFull, rules: AdmissionRules, resolved: bool
    ) -> Refusal:
        """A request refused before any limit was asked: invalid, or 429 `tokenizer_busy` with the
        `x-ratelimit-*` of its keys as every 429 carries them (its model's only once its body was read and
        `resolved`: before, which model it asks is not known)."""
        if isinstance(exc, LaneFull):
            acquisition = Acquisition(self.service, self.request, self.limit_pool, rules)
            status = await acquisition.status(acquisition.keys(model=resolved))
            return self.refuse(refusals.tokenizer_busy(exc.retry_after_s, status))
        return self.refuse(refusals.invalid(exc))

    async def admit(
        self, candidate: Candidate, rules: AdmissionRules
    ) -> AsyncIterator[Hold | Granted | Refusal | Shadowed | None]:
        """Try `candidate`: check the KV budget, book, acquire a lease (or wait in the class's queue), give
        the booking back if not admitted, grant. Yields `Hold` before it waits, then one outcome; None for a
        try on the bound that a bucket or a slot refused (count it, and try the exact need)."""
        request, service = self.request, self.service
        shadow = rules.shadow or request.klass.shadow
        booking = candidate.booking
        # A try on the bound was checked against the budget already, without claiming (`provisional.py`).
        fits, headroom = (True, None) if candidate.on_bound else candidate.fits(service.clock())
        acquisition = Acquisition(service, request, self.limit_pool, rules)
        waits = acquisition.may_wait(shadow) and not candidate.on_bound
        if not fits and not waits:
            yield self._deny(await self._kv_refusal(candidate, headroom, acquisition), shadow)
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
            inject = rules.inject_include_usage
            admitted, forward = candidate.grant(result, request, self.model_label, inject, service.clock())
            service.count_admitted(admitted)
            lane = self.tokenizer_lane
            correction = provisional.Correction(service, lane) if candidate.on_bound else None
            yield Granted(admitted, forward, correction)
        elif isinstance(result, Rejection) and candidate.on_bound:
            yield None
        else:
            assert result is not None
            yield await self._not_admitted(result, candidate, gate, fits, shadow, acquisition)

    async def _not_admitted(
        self,
        result: Rejection | Refusal,
        candidate: Candidate,
        gate: KvGate,
        fits: bool,
        shadow: bool,
        acquisition: Acquisition,
    ) -> Refusal | Shadowed:
        """The outcome of `acquisition`, a try the limiter rejected, or whose wait ended refused."""
        if isinstance(result, Rejection):
            refusal = refusals.rate_limited(
                self.service.retry_hint(result), candidate.parsed.model, gate.plan.total
            )
            return self._deny(refusal, shadow)
        if not fits and result.reason == "queue_timeout":
            # Waited its whole bound for KV: the budget's forecast says when to try again.
            headroom = gate.booking.fits(gate.request, gate.plan)[1]
            result = await self._kv_refusal(candidate, headroom, acquisition)
        return self.refuse(result)

    def _run_seconds(self, candidate: Candidate) -> float:
        """How long this request is expected to hold its slot: its expected completion per sequence at the
        pool's decode rate, as an open lease's remaining time is reckoned (`InFlight.open_lease`)."""
        parsed = candidate.parsed
        allowance = candidate.plan.completion_tokens / max(1, parsed.sequences * parsed.prompt_count)
        return candidate.booking.expected_completion(allowance) / self.service.paces.rate(candidate.pool)

    async def _kv_refusal(
        self, candidate: Candidate, headroom: int | None, acquisition: Acquisition
    ) -> Refusal:
        """The KV budget's 429, with its forecast `retry-after` (taken before any await: the budget's plan
        of places is as of this decision) and the limiter's view of the request's keys as its
        `x-ratelimit-*` headers, as a slot refusal carries them (`Acquisition.status`: none where the store
        cannot say now, rather than wait or fail)."""
        budget = candidate.booking.budget
        assert budget is not None
        wait = refusals.kv_retry_after(budget, self.service.clock())
        if budget.fleet.reads_due:  # its replica reads the others' figures when its client comes back
            candidate.booking.changed(candidate.booking.pool)
        status = await acquisition.status()
        return refusals.kv_budget(candidate.parsed.model, candidate.plan.total, headroom or 0, wait, status)
