"""`Admitted`: what an admitted request holds (its lease and its KV-budget entry) and the facts its settlement
needs, never its body. The decision makes it, the in-flight request carries it, settlement reads it."""

from __future__ import annotations

from dataclasses import dataclass

from extproc.admission.capacity.booking import KvBooking
from extproc.admission.intake.request import ParsedRequest
from extproc.admission.intake.reservation import Reservation
from extproc.admission.vocabulary.policy import ClassPolicy, ModelPolicy
from extproc.core.kv.budget import KvBudget
from extproc.core.limiter.limiter import Lease


@dataclass(frozen=True, slots=True)
class Admitted:
    """An admitted request: the lease it holds and the facts its settlement needs (never the body)."""

    lease: Lease
    request: ParsedRequest
    policy: ModelPolicy
    pool: str
    plan: Reservation
    tenant: str
    klass: ClassPolicy
    model_label: str
    booking: KvBooking  # its entry in the pool's KV budget (booked before the lease was granted)
    strip_usage: bool
    admitted_at: float

    @property
    def budget(self) -> KvBudget | None:
        return self.booking.budget
