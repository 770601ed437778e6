"""What the decision works on: the request's facts, and one try to admit it.

`RequestFacts` is what the request line and headers settled before the body came.

A request is tried at most twice: on its prompt's upper bound, where the bound decides (`provisional.py`),
and on its exact count. Each try is a `Candidate`, and `Decision.admit` (decision.py) is the one path over
it: check the KV budget, book it, acquire a lease (or wait), give the booking back if not admitted, grant.
"""

from __future__ import annotations

from dataclasses import dataclass

from extproc.admission.capacity.booking import KvBooking
from extproc.admission.intake.request import Api, ParsedRequest, Reservation
from extproc.admission.vocabulary.policy import ClassPolicy, ModelPolicy


@dataclass(frozen=True, slots=True)
class RequestFacts:
    """What the request line and headers settled: the API, the tenant and its class, the client."""

    api: Api
    tenant: str
    klass: ClassPolicy
    client: str | None = None
    # The client's deadline for its first token on the service's clock, and as it asked (milliseconds
    # from arrival, extproc/admission/intake/deadline.py); None without one.
    deadline: float | None = None
    deadline_ms: int | None = None


@dataclass(frozen=True, slots=True)
class Candidate:
    """The request as parsed, its model's policy, the pool whose engines serve it (its KV budget and decode
    pace), the reservation tried, and its entry in that pool's KV budget (a new one per try)."""

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
