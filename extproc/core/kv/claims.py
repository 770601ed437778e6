"""The KV budget's fair shares and claims (`KvBudget`, with a `FairShare`, `kv_fairness`): each admission
counts as its tenant's attained KV service, and a refused request claims the KV it needs from later requests
of other tenants in its class (and of less important ones), its tenant having received less; its retry then
fits. A refusal's `retry-after` is its place in the schedule of refused requests (`kv_schedule`), or, refused
for its tenant's share, when that tenant's first lease ends. Without a `now` (no clock) or a `FairShare` the
budget admits whatever fits.

Pure: no clock, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from extproc.core.kv.fairness import ClaimId, FairShare
from extproc.core.kv.lease import Lease
from extproc.core.kv.ledger import Ledger
from extproc.core.kv.pacing import BudgetPace
from extproc.core.kv.schedule import RetrySchedule


def claim_id(lease: Lease, rank: int) -> ClaimId:
    """How the request of `lease` is known on its retries (`kv_fairness`): a client retries one body."""
    chunks = lease.chunks
    if chunks.hashes:
        return ClaimId(rank, lease.learner_key, lease.sequences, (chunks.hashes[-1], chunks.text_chars))
    return ClaimId(rank, lease.learner_key, lease.sequences, (lease.prompt, lease.allowance))


class FairClaims:
    """One pool's refusals and their claims, against its tenants' fair shares where it has them."""

    def __init__(self, ledger: Ledger, fairness: FairShare | None) -> None:
        self._ledger = ledger
        self.fairness = fairness
        self.schedule = RetrySchedule()
        self._refused: tuple[ClaimId, int, float] | None = None  # the last refusal's (id, footprint, run)
        self._over_share = False  # whether the last refusal was for its tenant's share (`kv_fairness`)

    def fits(
        self,
        candidate: Lease,
        rank: int,
        booked_with: int,
        budget: int,
        now: float | None,
        claim: bool,
        spared: int = 0,
    ) -> bool:
        """Whether `candidate`, booked to `booked_with` with it, fits `budget` (`KvBudget.would_fit`); a
        refusal is remembered for its `retry_after`. Its claim and its promised place hold what it adds to
        the booking: its footprint less the tokens its shared prefixes spare the leases that hold them
        (`spared`, `PrefixCredit.book_with`). Planned at its whole footprint, each of a burst's refused
        chats that share a 1,666-token system prompt held the prompt again in its place: seven places a
        wave where the cache held thirty (the real-engine tier's shared-prefix overload)."""
        footprint = max(0, candidate.footprint - spared)
        claimant = claim_id(candidate, rank)
        fair = self.fairness
        if fair is None or now is None:
            fits = booked_with <= budget
        else:
            fits = self._fits_fairly(fair, claimant, footprint, booked_with, budget, now, claim)
        if not fits:
            # What `retry_after` fits in the schedule: this request, what it adds, its run in engine steps.
            self._refused = (claimant, footprint, candidate.expected_completion / candidate.sequences)
        return fits

    def unrefused(self) -> None:
        """A new decision: not refused for its tenant's share unless it says so."""
        self._over_share = False

    def _fits_fairly(
        self,
        fair: FairShare,
        claimant: ClaimId,
        footprint: int,
        booked_with: int,
        budget: int,
        now: float,
        claim: bool,
    ) -> bool:
        """`fits` with fair shares: the candidate fits beside another tenant's claim, and its tenant is not
        over its share while another tenant waits (`kv_fairness`). A refusal claims only for a tenant
        within its share (not on a bound's check, nor beyond the whole budget), and its tenant waits."""
        over = fair.others_wait(claimant, now) and fair.over_share(
            claimant, self._ledger.held_by_tenant(), footprint, now
        )
        fits = not over and booked_with + fair.withheld(claimant, now) <= budget
        self._over_share = over
        if not fits and claim:
            if over:
                fair.waits(claimant, now + fair.claim_ttl_s)
            elif footprint <= budget:  # one larger fits only an empty pool: it neither claims nor waits
                fair.refused(claimant, footprint, now)
        return fits

    def admitted(self, lease: Lease, rank: int, now: float | None) -> None:
        """An admitted request keeps its promised place no more, and counts as its tenant's service."""
        claimant = claim_id(lease, rank)
        self.schedule.kept(claimant)
        if self.fairness is not None and now is not None:
            self.fairness.admitted(claimant, lease.footprint, now)

    def served(self, tenant: str, tokens: int, now: float | None) -> None:
        """`tenant`'s attained service changed by `tokens`: a prompt booked on its bound, corrected to its
        exact count, is lowered by as much. Counted at the bound's footprint, a tenant of short prompts (whose
        byte bound is about twice their count) had received twice its due by that measure, so a tenant of long
        prompts won every rounding past its share and held 54-63 % of the cache per window."""
        if self.fairness is not None and now is not None:
            self.fairness.served(tenant, tokens, now)

    def retry_after(
        self,
        now: float | None,
        budget: int | None,
        pace: BudgetPace,
        booked_with: int,
        others: Sequence[tuple[float, int]] = (),
        own_part: float = 1.0,
    ) -> float | None:
        """`KvBudget.retry_after`, at the pace hints take (`BudgetPace.hint_rate`), the refused request having
        been compared with `booked_with` against `budget`.

        Leases end at their forecast ends (`trajectory`: expected completion less tokens done, in steps
        of one token per sequence) at the pace, plus the first-token delay still ahead of a lease with no
        progress yet; each end frees its lifetime footprint from the booking the refused request was
        compared with, or the part of it this replica may book again (`own_part`, `Fleet.release_part`);
        the other replicas' ends free its part of theirs (`others`, `Fleet.others_releases`). The refused
        request is expected to run its own expected completion at that pace. None with no pace, or nothing
        to wait for.
        """
        rate = pace.hint_rate()
        refused = self._refused
        leases = self._ledger.leases
        if budget is None or now is None or rate is None or rate <= 0 or refused is None:
            return None
        own = pace.releases(leases.values(), now) or []
        releases = [(seconds, math.floor(tokens * own_part)) for seconds, tokens in own] + list(others)
        if not releases:
            return None
        owner, footprint, completion = refused
        fair = self.fairness
        delay = pace.learned.first_token_delay
        if fair is not None and self._over_share:
            return self._share_eta(fair, owner, now, rate, delay)
        first = fair is not None and fair.holds(owner, now)
        served = fair.standing(owner.tenant, now) if fair is not None else 0.0
        duration = delay + completion / rate
        priority = (float(owner.rank), served)
        standing = None if fair is None else (lambda tenant: fair.standing(tenant, now))
        eta = self.schedule.eta(
            owner,
            now,
            booked_with,
            budget,
            releases,
            duration,
            footprint,
            first,
            priority,
            owner.tenant,
            standing,
        )
        if fair is not None:
            fair.waits(owner, now + eta + fair.claim_ttl_s)  # its tenant waits until it is due back
            if first:
                fair.keep_until(owner, now + eta)  # the claim waits for its owner's return
        return eta

    def _share_eta(self, fair: FairShare, owner: ClaimId, now: float, rate: float, delay: float) -> float:
        """A request refused for its tenant's share: back when the tenant's first lease ends and its share
        falls. It takes no place in the schedule: the places are the waiting tenants' (module docstring
        of `kv_fairness`), and a flood's refusals would push them later."""
        ends = [
            lease.seconds_left(now, rate, delay)
            for lease in self._ledger.leases.values()
            if lease.learner_key == owner.tenant
        ]
        eta = min(ends, default=0.0)
        fair.waits(owner, now + eta + fair.claim_ttl_s)
        return eta
