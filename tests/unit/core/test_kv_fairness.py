"""Fair shares of a pool's KV (extproc/core/kv_fairness.py): attained service decays, the claim goes to the
tenant that received least, holds against everyone but its owner, and lapses when its owner stops asking."""

from __future__ import annotations

import random

import pytest

from extproc.core.kv_budget import Booking, KvBudget
from extproc.core.kv_fairness import ClaimId, FairShare

LARGE = ClaimId(1, "long", 1, (1, 12_000))
SMALL = ClaimId(1, "short", 1, (2, 400))


def test_attained_service_decays_by_half_life_and_divides_by_weight() -> None:
    fair = FairShare(half_life_s=10.0, weights={"gold": 2.0})
    fair.served("a", 1000, now=0.0)
    fair.served("gold", 1000, now=0.0)
    assert fair.attained("a", 0.0) == 1000
    assert fair.attained("a", 10.0) == pytest.approx(500)
    assert fair.attained("gold", 10.0) == pytest.approx(250)
    fair.served("a", 500, now=10.0)
    assert fair.attained("a", 20.0) == pytest.approx(500)
    assert fair.attained("unknown", 20.0) == 0.0


def test_the_fairness_index_is_one_for_equal_service_and_falls_with_skew() -> None:
    fair = FairShare()
    assert fair.fairness_index(0.0) == 1.0
    fair.served("a", 100, 0.0)
    assert fair.fairness_index(0.0) == 1.0  # one tenant: nothing to compare
    fair.served("b", 100, 0.0)
    assert fair.fairness_index(0.0) == pytest.approx(1.0)
    fair.served("b", 800, 0.0)
    assert fair.fairness_index(0.0) == pytest.approx(1000**2 / (2 * (100**2 + 900**2)))
    assert fair.shares(0.0) == pytest.approx({"a": 0.1, "b": 0.9})


def test_a_refused_request_claims_its_kv_from_other_tenants_until_it_is_admitted() -> None:
    fair = FairShare()
    fair.refused(LARGE, 3500, now=0.0)
    assert fair.withheld(SMALL, 1.0) == 3500
    assert fair.withheld(ClaimId(1, "long", 1, (3, 480)), 1.0) == 0  # its own tenant's: first come
    assert fair.withheld(LARGE, 1.0) == 0
    fair.admitted(LARGE, 3500, now=2.0)
    assert fair.claim is None and fair.withheld(SMALL, 2.0) == 0
    assert fair.attained("long", 2.0) == 3500
    assert fair.attained("long", 32.0) == pytest.approx(1750)


def test_the_claim_goes_to_the_tenant_that_received_least_and_not_back() -> None:
    fair = FairShare()
    fair.served("short", 10_000, now=0.0)
    fair.refused(SMALL, 600, now=0.0)
    assert fair.claim is not None and fair.claim.owner == SMALL
    fair.refused(LARGE, 3500, now=0.5)  # "long" received nothing: it takes the claim over
    assert fair.claim is not None and fair.claim.owner == LARGE
    fair.refused(SMALL, 600, now=1.0)  # and "short" cannot take it back
    assert fair.claim.owner == LARGE
    fair.refused(LARGE, 3400, now=1.5)  # the owner's own retry renews it
    assert fair.claim.tokens == 3400 and fair.claim.until == 11.5


def test_classes_keep_their_order_claims_work_inside_a_class() -> None:
    fair = FairShare()
    interactive = ClaimId(0, "short", 1, (4, 400))
    batch = ClaimId(2, "long", 1, (5, 12_000))
    fair.refused(batch, 3500, now=0.0)
    assert fair.withheld(interactive, 0.0) == 0  # a batch claim never holds back a more important class
    assert fair.withheld(ClaimId(2, "x", 1, (10, 10)), 0.0) == 3500
    fair.served("short", 10_000, now=0.0)  # however much it received, the better class takes the claim
    fair.refused(interactive, 600, now=0.5)
    assert fair.claim is not None and fair.claim.owner == interactive
    fair.refused(batch, 3500, now=1.0)
    assert fair.claim.owner == interactive


def test_a_claimant_that_stops_asking_loses_its_claim_after_the_ttl() -> None:
    fair = FairShare(claim_ttl_s=10.0)
    fair.refused(LARGE, 3500, now=0.0)
    assert fair.withheld(SMALL, 10.0) == 3500
    assert fair.withheld(SMALL, 10.1) == 0
    assert fair.claim is None


def test_memory_is_bounded_by_forgetting_the_least_recently_served() -> None:
    fair = FairShare(max_tenants=2)
    for index, tenant in enumerate(("a", "b", "c")):
        fair.served(tenant, 100, float(index))
    assert fair.attained("a", 3.0) == 0.0 and fair.attained("c", 3.0) > 0


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError):
        FairShare(half_life_s=0)
    with pytest.raises(ValueError):
        FairShare(weights={"a": 0.0})


def budget(fair: FairShare | None) -> KvBudget:
    """4,096 KV tokens, 3,686 of them to fill, booked by lifetime (no feed): only the arithmetic counts."""
    return KvBudget(4096, booking=Booking.LIFETIME, fairness=fair)


def test_in_the_budget_a_refused_request_keeps_its_space_from_a_later_smaller_one() -> None:
    fair = FairShare()
    fair.served("short", 10_000, now=0.0)  # the small requests' tenant has received more lately
    kv = budget(fair)
    kv.admit("a", 8, 1500, "long", now=0.0)
    kv.admit("b", 8, 1500, "long", now=0.0)
    assert kv.would_fit(8, 1500, "long", now=1.0) == (False, 3686 - 3016)  # it claims 1,508
    assert kv.would_fit(8, 50, "short", now=1.5)[0] is False  # would fit alone (58 of 670 free)
    assert kv.would_fit(8, 50, "short", now=1.5, rank=-1)[0] is True  # a more important class would not wait
    kv.release("a", 1500)
    assert kv.would_fit(8, 1500, "long", now=2.0)[0] is True  # the claimant comes back: in
    kv.admit("c", 8, 1500, "long", now=2.0)
    assert fair.claimed_tokens(2.0) == 0
    assert kv.would_fit(8, 50, "short", now=2.5)[0] is True  # the claim went with its admission


def test_a_request_larger_than_the_budget_or_checked_on_a_bound_claims_nothing() -> None:
    fair = FairShare()
    kv = budget(fair)
    kv.admit("a", 8, 1500, "long", now=0.0)
    assert kv.would_fit(8, 4000, "huge", now=1.0)[0] is False  # fits only an empty pool: no claim
    assert kv.would_fit(8, 2500, "long", now=1.0, claim=False)[0] is False  # a bound's check: no claim
    assert fair.claimed_tokens(1.0) == 0
    assert kv.would_fit(8, 2500, "long", now=1.0)[0] is False
    assert fair.claimed_tokens(1.0) == 2508


def test_without_fair_shares_the_smaller_request_takes_the_space() -> None:
    kv = budget(None)
    kv.admit("a", 8, 1500, "long", now=0.0)
    kv.admit("b", 8, 1500, "long", now=0.0)
    assert kv.would_fit(8, 1500, "long", now=1.0)[0] is False
    assert kv.would_fit(8, 50, "short", now=1.5)[0] is True


def test_backlogged_tenants_whose_sizes_differ_thirty_fold_each_get_about_half_the_kv() -> None:
    """64 clients of 100-token prompts beside 8 clients of 3,000-token ones, each asking for more than half
    of a 16,384-token cache (200 output tokens each), each request holding its KV for 5-15 s, every client
    trying again every 0.1 s until admitted (in a seeded random order). Without fair shares the small
    requests take the space as it frees (the large tenant got 5 %); with them the KV service splits about
    evenly (50 %)."""

    def run(fair: FairShare | None) -> float:
        kv = KvBudget(16_384, booking=Booking.LIFETIME, fairness=fair)
        rng = random.Random(7)
        clients = [("short", 100, i) for i in range(64)] + [("long", 3000, i) for i in range(8)]
        busy_until: dict[tuple[str, int, int], float] = {}
        got = {"long": 0, "short": 0}
        now = 0.0
        while now < 120.0:
            for client, until in list(busy_until.items()):
                if until <= now:
                    kv.release(str(client), 200)
                    del busy_until[client]
            waiting = [c for c in clients if c not in busy_until]
            rng.shuffle(waiting)
            for client in waiting:
                tenant, size, _ = client
                if kv.would_fit(size, 200, tenant, now=now)[0]:
                    kv.admit(str(client), size, 200, tenant, now=now)
                    busy_until[client] = now + rng.uniform(5.0, 15.0)
                    got[tenant] += size + 200
            now = round(now + 0.1, 1)
        return got["long"] / (got["long"] + got["short"])

    unfair, fair = run(None), run(FairShare())
    assert unfair < 0.2, unfair
    assert 0.4 <= fair <= 0.6, fair
