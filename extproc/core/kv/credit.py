"""How far below their completion allowance one tenant's admitted requests may be booked, in all.

The KV budget books a request's expected completion, a share of its allowance learned from its tenant's own
finished answers (`completion_learner`). That share is the tenant's to steer: forty requests with
`max_tokens: 4000` that stop after one token train it to its floor, and a burst of twelve such requests that
then run to the end was booked 420 tokens each and took the cache into preemption (13 preemptions, KV peak
1.00, on `make run`'s 16,384-token cache). A per-tenant learner keeps a tenant from moving another's
estimate; the cache they overflow is still shared.

So the learned share is a credit, and a bounded one: the tokens a tenant's admitted requests are booked below
their allowances (their *unconfirmed* completion: nothing but the tenant's history says they will stop early)
add up to at most `limit` tokens. A request whose credit does not fit what is left is booked with only what
is left, up to its whole allowance. With the limit at the cache's margin above the budget's default target
(`kv_budget.unconfirmed_share`, 0.1 of the capacity), a tenant's requests together can outgrow their booking
by no more than the margin the budget keeps free, whatever they were trained to look like: the burst
above books four requests (the first with the credit left, three at their allowance), which end at 16,128
tokens of 16,384. A tenant whose answers really are short keeps the credit of its requests up to the limit;
past it, its requests are booked whole, and fewer run at once. The bound holds for forecast booking only
because the forecast keeps a credited lease at its expected size until its allowance's end (`Lease.pieces`):
freed at its expected end it would free all of its footprint there, not only its credit.

Pure; memory is one integer per tenant with requests in flight.
"""

from __future__ import annotations


class UnconfirmedCredit:
    """Each tenant's tokens booked below the allowances of its requests in flight, against one limit."""

    __slots__ = ("_held", "limit")

    def __init__(self) -> None:
        self.limit: int | None = None  # None: no bound (the pool's capacity unknown)
        self._held: dict[str, int] = {}

    def expected(self, tenant: str, allowance: int, learned: int) -> int:
        """The completion to book for a request of `tenant` with this `allowance`, learned to use `learned`:
        the learned share where its credit (`allowance - learned`) fits what the tenant has left, else the
        allowance less what is left."""
        if self.limit is None or learned >= allowance:
            return learned
        left = max(0, self.limit - self._held.get(tenant, 0))
        return max(learned, allowance - left)

    def take(self, tenant: str, credit: int) -> None:
        """A request of `tenant` admitted `credit` tokens below its allowance."""
        if credit > 0:
            self._held[tenant] = self._held.get(tenant, 0) + credit

    def give_back(self, tenant: str, credit: int) -> None:
        """That request released (or re-booked at its allowance): its credit is free again."""
        if credit <= 0:
            return
        held = self._held.get(tenant, 0) - credit
        if held > 0:
            self._held[tenant] = held
        else:
            self._held.pop(tenant, None)

    def held(self, tenant: str) -> int:
        return self._held.get(tenant, 0)
