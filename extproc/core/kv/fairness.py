"""Fair shares of one pool's KV cache between tenants: attained service, and the one claim that keeps a large
request from starving behind smaller ones.

A KV budget that admits whatever fits now starves whoever needs the larger piece: each time KV frees, a
flood of small requests fits first and the large one is refused again (measured: a tenant sending
3,000-token prompts beside one sending 100-token prompts got 22 % of the admitted tokens and a TTFT p99 of
40 s). Two rules, as backfilling batch schedulers do it:

* **Attained service.** Each tenant's admitted KV (prompt + expected completion, the footprint booked) is
  summed with exponential decay (`half_life_s`), divided by the tenant's weight (default 1): who has
  received the least lately is next by fairness. The lag is bounded (`standing`): no tenant stands more
  than the largest admission lately behind the most served one, so a tenant left behind while the cache
  filled from empty is owed one large request, not its whole deficit.
* **One claim per pool.** A refused request claims the KV it needs when no claim is held, or when its
  tenant has attained less than the claimant's. While the claim holds, other tenants' requests fit
  only beside it (the budget withholds the claim's tokens from them), so later, smaller requests cannot
  take the space as it frees; the claimant, coming back (its `retry-after` points at when
  its KV frees, planned before any other refused request's), fits and is admitted, and the claim goes. A
  claimant that does not come back within `claim_ttl_s` of its last refusal, or of the time it was told
  to come back, loses the claim, so a client that gave up holds nothing for long.

A request is recognised on its retries by its identity (`ClaimId`: tenant, sequences and the body's shape,
which the caller derives from the prompt). A claim holds against the other tenants only: inside one tenant
admission stays first come, first served (measured on a one-tenant overload of a real vLLM, a claim held
against the claimant's own tenant left its space idle between retries and cost answered requests). A request
larger than the whole budget claims nothing: it fits only an empty pool, and a claim for it would drain the
pool for one request.

* **No more than its share while another waits.** A tenant whose part of the KV held now (the admitted
  footprints) is over its weighted share of the tenants holding or waiting is refused while another tenant
  of its class (or a more important one) waits, i.e. was refused within `claim_ttl_s` or was told to come
  back and is not `claim_ttl_s` past that time. One claim at a time lets the starved tenant in one request
  per release, and the space each release frees beside the claim went to the flood again: measured on the
  local stack, the large-request tenant held 7 % of the cache in the first 10 s and 27 % in the next 20 s,
  then, still owed by its decayed service, 60-72 %. With the guard each tenant grows to its share and
  stops there; the claimant itself passes (its claim would otherwise stand empty). A tenant under its share
  is never held back by it, and it needs no total: the footprints the budget books by forecast may sum
  past the budget, so shares are of what is held, not of the budget.

Classes keep their order: a claim holds only against requests of its own class or a less important one
(`ClaimId.rank`), and a refused request of a more important class takes the claim over whatever the
tenants received, so fairness works inside a class and shedding (batch first) stays as it was.

Pure and synchronous: callers pass `now`; memory is bounded by `max_tenants` (the least recently served
tenant is forgotten, i.e. treated as having received nothing, which favours it: the safe direction).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import NamedTuple


class ClaimId(NamedTuple):
    """What makes one request recognisable on its retries (a client retries the same body), and its class's
    rank (0: the most important class). `shape` is what the caller knows of the body: for a text prompt its
    last chunk hash and its length in characters, which do not depend on how its tokens were counted (a
    bound first, the exact count later); else its prompt tokens and completion allowance."""

    rank: int
    tenant: str
    sequences: int
    shape: tuple[int, int]


@dataclass(slots=True)
class Claim:
    """The KV one refused request keeps from later ones until it comes back."""

    owner: ClaimId
    tokens: int
    until: float  # when it lapses: `claim_ttl_s` after its owner's last refusal, or after the retry time
    # its owner was given (`keep_until`), whichever is later


@dataclass
class FairShare:
    half_life_s: float = 30.0
    claim_ttl_s: float = 10.0
    max_tenants: int = 1000
    weights: Mapping[str, float] = field(default_factory=dict)
    _service: OrderedDict[str, tuple[float, float]] = field(default_factory=OrderedDict, init=False)
    _claim: Claim | None = field(default=None, init=False)
    # The most served tenant (tenant, weighted service, when) and the largest admission lately (tokens,
    # when): `standing`'s bounded lag.
    _top: tuple[str, float, float] | None = field(default=None, init=False)
    _largest: tuple[float, float] = field(default=(0.0, 0.0), init=False)
    # Tenants with a refused request that may come back: tenant -> (its most important rank, until when).
    _waiting: OrderedDict[str, tuple[int, float]] = field(default_factory=OrderedDict, init=False)

    def __post_init__(self) -> None:
        if not self.half_life_s > 0 or not self.claim_ttl_s > 0 or self.max_tenants < 1:
            raise ValueError("half_life_s and claim_ttl_s must be > 0, max_tenants >= 1")
        for tenant, weight in self.weights.items():
            if not (weight > 0 and math.isfinite(weight)):
                raise ValueError(f"weight of tenant {tenant!r} must be a finite number > 0, got {weight}")

    # -- attained service -----------------------------------------------------------------------------------

    def attained(self, tenant: str, now: float) -> float:
        """The tenant's decayed admitted KV tokens, divided by its weight, as of `now`."""
        entry = self._service.get(tenant)
        if entry is None:
            return 0.0
        value, at = entry
        return value * self._decay(now - at) / self.weights.get(tenant, 1.0)

    def standing(self, tenant: str, now: float) -> float:
        """The tenant's attained service as the order of service reads it: never more than the largest
        admission seen lately below the most served tenant's (bounded lag, as start-time fair queueing
        starts a flow at the current virtual time). A tenant left behind while the cache filled from empty
        is owed one large request, not the whole deficit: repaying all of it took the large-request tenant
        to 63 % of the cache in the next 10 s window."""
        return max(self.attained(tenant, now), self._floor(now))

    def _floor(self, now: float) -> float:
        """The least weighted service a tenant stands at: the top's less the largest admission lately."""
        top, largest = self._top, self._largest
        if top is None:
            return 0.0
        return top[1] * self._decay(now - top[2]) - largest[0] * self._decay(now - largest[1])

    def served(self, tenant: str, tokens: float, now: float) -> None:
        """The tenant was admitted `tokens` of KV footprint at `now` (negative: a footprint admitted on a
        bound, lowered to its exact count; the service never falls below 0)."""
        entry = self._service.pop(tenant, None)
        value = 0.0 if entry is None else entry[0] * self._decay(now - entry[1])
        if tokens > 0:  # served from where it stands: a tenant left far behind is owed a bounded lag
            value = max(value, self._floor(now) * self.weights.get(tenant, 1.0))
        self._service[tenant] = (max(0.0, value + tokens), now)
        if tokens > self._largest[0] * self._decay(now - self._largest[1]):
            self._largest = (tokens, now)
        self._track_top(tenant, now)
        while len(self._service) > self.max_tenants:
            self._service.popitem(last=False)

    def _track_top(self, tenant: str, now: float) -> None:
        """Keep the most served tenant after `tenant`'s service changed: it takes the top if it passed it;
        the top tenant lowered (a correction) means a search, which is rare."""
        mine = self.attained(tenant, now)
        top = self._top
        if top is not None and top[0] == tenant and mine < top[1] * self._decay(now - top[2]):
            best = max(self._service, key=lambda t: self.attained(t, now))
            self._top = (best, self.attained(best, now), now)
        elif top is None or mine >= top[1] * self._decay(now - top[2]):
            self._top = (tenant, mine, now)

    def shares(self, now: float) -> dict[str, float]:
        """Each tenant's weighted attained service as a fraction of all tenants', for those served lately."""
        values = {tenant: self.attained(tenant, now) for tenant in self._service}
        total = sum(values.values())
        if total <= 0:
            return {}
        return {tenant: value / total for tenant, value in values.items() if value / total >= 0.001}

    def fairness_index(self, now: float) -> float:
        """Jain's index over the tenants' weighted attained service: 1 when all received the same, 1/n when
        one of n received everything; 1 with fewer than two tenants served lately."""
        values = [value for value in (self.attained(t, now) for t in self._service) if value > 0]
        if len(values) < 2:
            return 1.0
        return sum(values) ** 2 / (len(values) * sum(v * v for v in values))

    # -- the claim ------------------------------------------------------------------------------------------

    @property
    def claim(self) -> Claim | None:
        return self._claim

    def claimed_tokens(self, now: float) -> int:
        """The KV a claim holds at `now` (0: none, or it lapsed)."""
        claim = self._live_claim(now)
        return 0 if claim is None else claim.tokens

    def withheld(self, candidate: ClaimId, now: float) -> int:
        """KV tokens a decision on `candidate` must leave free: the claim's, unless the claim is its own
        tenant's, holds only against less important classes than its, or lapsed."""
        claim = self._live_claim(now)
        if claim is None or candidate.tenant == claim.owner.tenant or candidate.rank < claim.owner.rank:
            return 0
        return claim.tokens

    def refused(self, candidate: ClaimId, tokens: int, now: float) -> None:
        """`candidate`, needing `tokens` of KV, was refused at `now`: it claims them if no one holds a claim,
        or if it comes first (`_before`); the claimant's own refusal renews its claim. Its tenant waits."""
        self.waits(candidate, now + self.claim_ttl_s)
        claim = self._live_claim(now)
        if claim is not None and claim.owner == candidate:
            claim.until = max(claim.until, now + self.claim_ttl_s)
            claim.tokens = max(0, int(tokens))
            return
        if claim is not None and not self._before(candidate, claim.owner, now):
            return
        self._claim = Claim(candidate, max(0, int(tokens)), now + self.claim_ttl_s)

    # -- the share guard ----------------------------------------------------------------------------------

    def waits(self, candidate: ClaimId, until: float) -> None:
        """`candidate` was refused and may come back until `until` (its retry time, or now, plus
        `claim_ttl_s`): its tenant waits until then."""
        rank, before = self._waiting.pop(candidate.tenant, (candidate.rank, until))
        self._waiting[candidate.tenant] = (min(rank, candidate.rank), max(before, until))
        while len(self._waiting) > self.max_tenants:
            self._waiting.popitem(last=False)

    def over_share(self, candidate: ClaimId, held: Mapping[str, float], tokens: float, now: float) -> bool:
        """Whether `candidate` (needing `tokens`) would take its tenant over its weighted share of the KV
        the tenants hold now (`held`) while another tenant of its class or a more important one waits
        (module docstring). Over it now: yes. Over it only with this request: yes if the tenant has
        received more lately than a waiting one (`attained`), so history decides which tenant rounds up
        when requests are too large to split the cache exactly. The claimant passes: its claim holds its
        place."""
        if self.holds(candidate, now):
            return False
        waiting = self._waiting_against(candidate, now)
        if not waiting:
            return False
        tenant = candidate.tenant
        tenants = {t for t, kv in held.items() if kv > 0} | waiting | {tenant}
        total = sum(max(0.0, held.get(t, 0.0)) for t in tenants)
        weights = sum(self.weights.get(t, 1.0) for t in tenants)

        def over(who: str, adding: float = 0.0) -> bool:
            part = (max(0.0, held.get(who, 0.0)) + adding) / ((total + adding) or 1.0)
            return part > self.weights.get(who, 1.0) / weights

        # A waiting tenant over its own share could not take the space: it holds no one back (else two
        # tenants, each over by the other's measure, would refuse each other while the cache stands idle).
        owed = [other for other in waiting if not over(other)]
        if not owed:
            return False
        if over(tenant):
            return True
        if not over(tenant, tokens):
            return False
        ahead = self.standing(tenant, now)
        return any(ahead > self.standing(other, now) for other in owed)

    def others_wait(self, candidate: ClaimId, now: float) -> bool:
        """Whether a tenant other than `candidate`'s, of its class or a more important one, waits at `now`
        (cheap: the caller sums what each tenant holds only then)."""
        return bool(self._waiting_against(candidate, now))

    def _waiting_against(self, candidate: ClaimId, now: float) -> set[str]:
        for tenant in [t for t, (_, until) in self._waiting.items() if until < now]:
            del self._waiting[tenant]
        return {
            tenant
            for tenant, (rank, _) in self._waiting.items()
            if tenant != candidate.tenant and rank <= candidate.rank
        }

    def holds(self, candidate: ClaimId, now: float) -> bool:
        """Whether `candidate` holds the claim at `now`."""
        claim = self._live_claim(now)
        return claim is not None and claim.owner == candidate

    def keep_until(self, candidate: ClaimId, retry_at: float) -> None:
        """`candidate`, holding the claim, was told to come back at `retry_at`: the claim waits for it,
        `claim_ttl_s` past that time."""
        claim = self._claim
        if claim is not None and claim.owner == candidate:
            claim.until = max(claim.until, retry_at + self.claim_ttl_s)

    def admitted(self, candidate: ClaimId, tokens: float, now: float) -> None:
        """`candidate` was admitted with a footprint of `tokens`: its tenant is served, its claim goes."""
        self.served(candidate.tenant, tokens, now)
        if self._claim is not None and self._claim.owner == candidate:
            self._claim = None

    def _live_claim(self, now: float) -> Claim | None:
        claim = self._claim
        if claim is not None and now > claim.until:
            self._claim = claim = None
        return claim

    def _before(self, candidate: ClaimId, owner: ClaimId, now: float) -> bool:
        """Whether `candidate` comes before `owner`: a more important class, or in the same class a tenant
        with strictly less attained service."""
        if candidate.rank != owner.rank:
            return candidate.rank < owner.rank
        tenant, other = candidate.tenant, owner.tenant
        return tenant != other and self.standing(tenant, now) < self.standing(other, now)

    def _decay(self, elapsed: float) -> float:
        return math.exp(-math.log(2.0) * max(0.0, elapsed) / self.half_life_s)
