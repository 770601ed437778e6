"""What the decision works on: the request's facts, and one try to admit it.

`RequestFacts` is what the request line and headers settled before the body came.

A request is tried at most twice: on its prompt's upper bound, where the bound decides (`provisional.py`),
and on its exact count. Each try is a `Candidate`, and `Decision.admit` (decision.py) is the one path over
it: check the KV budget, book it, acquire a lease (or wait), give the booking back if not admitted, grant:
`Candidate.grant` turns the try and its lease into what the request holds (`Admitted`) and how it goes
upstream (`Forward`), in one call.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from extproc.admission.capacity.admitted import Admitted
from extproc.admission.capacity.booking import KvBooking
from extproc.admission.intake.request import USAGE_OPTION_APIS, Api, BodyEdits, ParsedRequest, edit_body
from extproc.admission.intake.reservation import Reservation
from extproc.admission.replies.verdicts import FORWARD, Forward
from extproc.admission.vocabulary.names import PRIORITY_HEADER
from extproc.admission.vocabulary.policy import ClassPolicy, ModelPolicy
from extproc.core.limiter.limiter import Lease


@dataclass(frozen=True, slots=True)
class RequestFacts:
    """What the request line and headers settled: the API, the tenant and its class, the client, and the
    body's content type (its API's body format reads it)."""

    api: Api
    tenant: str
    klass: ClassPolicy
    client: str | None = None
    # The client's deadline for its first token on the service's clock, and as it asked (milliseconds
    # from arrival, extproc/admission/intake/deadline.py); None without one.
    deadline: float | None = None
    deadline_ms: int | None = None
    content_type: str | None = None  # the request's `content-type` header, None without one
    # The engine the picker chose (`intake/endpoint.py`), where trusted: its KV budget books the request.
    endpoint: str | None = None


@dataclass(frozen=True, slots=True)
class Candidate:
    """The request as parsed, its model's policy, the pool whose engines serve it (its KV budget and decode
    pace), the reservation tried, and the request's entry in that pool's KV budget (one per request: a try
    not admitted gives it back before the next books it again)."""

    parsed: ParsedRequest
    policy: ModelPolicy
    pool: str
    plan: Reservation
    booking: KvBooking
    # Tried on the prompt's upper bound: it never waits in a queue, and a refusal of a bucket or a slot sends
    # it to be counted and tried again on its exact need; granted, its exact count follows (`Correction`).
    on_bound: bool = False

    def fits(self, now: float | None = None, *, claim: bool = True) -> tuple[bool, int | None]:
        """Whether the reservation fits the pool's KV budget, and the headroom before it (`KvBooking`)."""
        return self.booking.fits(self.parsed, self.plan, now, claim=claim)

    def grant(
        self, lease: Lease, request: RequestFacts, model_label: str, inject_usage: bool, now: float
    ) -> tuple[Admitted, Forward]:
        """Admitted with `lease`: what the request holds, with the facts its settlement needs (not the parsed
        body: a request must not hold megabytes of JSON while it runs), and how it goes upstream: the body
        edited (usage asked for in a stream under `inject_usage`, the output bound written, the priority
        field stripped or set), the priority header vLLM reads on every API (the Messages API has no body
        field for it), and whether to strip a usage event the client did not ask for."""
        parsed, klass = self.parsed, request.klass
        priority = klass.backend_priority
        edits = BodyEdits(
            include_usage=inject_usage,
            max_tokens=self.plan.injected_max_tokens,
            strip_priority=True,
            priority=priority,
        )
        new_body = edit_body(parsed, edits)
        strip_usage = (
            inject_usage and parsed.stream and not parsed.include_usage and parsed.api in USAGE_OPTION_APIS
        )
        admitted = Admitted(
            lease=lease,
            request=replace(parsed, body={}),
            policy=self.policy,
            pool=self.pool,
            plan=self.plan,
            tenant=request.tenant,
            klass=klass,
            model_label=model_label,
            booking=self.booking,
            strip_usage=strip_usage,
            admitted_at=now,
        )
        headers: tuple[tuple[str, str], ...] = ()
        if priority is not None:
            headers = ((PRIORITY_HEADER, str(priority)),)
        if new_body is None:
            return admitted, Forward(set_headers=headers) if headers else FORWARD
        return admitted, Forward(
            set_headers=(*headers, ("content-length", str(len(new_body)))), body=new_body
        )
