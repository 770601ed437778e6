"""Fair shares of a pool's KV (extproc/core/kv/fairness.py): attained service decays, the claim goes to the
tenant that received least, holds against everyone but its owner, and lapses when its owner stops asking."""

from __future__ import annotations

import random

import pytest

from extproc.core.kv.budget import BookingMode, KvBudget
from extproc.core.kv.fairness import ClaimId, FairShare

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
    return KvBudget(4096, booking=BookingMode.LIFETIME, fairness=fair)


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
        kv = KvBudget(16_384, booking=BookingMode.LIFETIME, fairness=fair)
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


def test_a_tenant_over_its_share_is_refused_while_another_waits_and_one_under_it_is_not() -> None:
    fair = FairShare()
    held = {"short": 6000.0, "long": 3000.0}
    assert fair.over_share(SMALL, held, 400, now=0.0) is False  # nobody waits: no guard
    fair.waits(LARGE, 10.0)
    assert fair.over_share(SMALL, held, 400, now=1.0) is True  # 67 % of what is held, the other waits
    assert fair.over_share(LARGE, held, 3000, now=1.0) is False  # the waiting tenant is under its share
    assert fair.over_share(SMALL, held, 400, now=10.5) is False  # the wait lapsed: no guard


def test_a_waiting_tenant_over_its_own_share_holds_no_one_back() -> None:
    """Each over its share by the other's measure would refuse the other while the cache stands idle."""
    fair = FairShare()
    fair.waits(LARGE, 10.0)
    fair.waits(SMALL, 10.0)
    fair.served("short", 5000, now=0.0)  # the small tenant has received more: it would not round up
    held = {"short": 3000.0, "long": 3200.0}
    assert fair.over_share(LARGE, held, 3000, now=1.0) is True  # over its share now
    assert fair.over_share(SMALL, held, 400, now=1.0) is False  # only the over-share tenant waits


def test_which_tenant_rounds_up_past_its_share_is_decided_by_what_each_received() -> None:
    """A request too large to split the cache exactly goes over the share only for the tenant that has
    received less lately."""
    held = {"short": 6600.0, "long": 6600.0}  # each at its share: one more long request goes past it
    behind = FairShare()
    behind.served("short", 9000, now=0.0)
    behind.served("long", 6000, now=0.0)
    behind.waits(SMALL, 10.0)
    assert behind.over_share(LARGE, held, 3300, now=1.0) is False
    ahead = FairShare()
    ahead.served("short", 6000, now=0.0)
    ahead.served("long", 9000, now=0.0)
    ahead.waits(SMALL, 10.0)
    assert ahead.over_share(LARGE, held, 3300, now=1.0) is True


def test_the_claimant_passes_the_share_guard() -> None:
    fair = FairShare()
    fair.refused(LARGE, 3000, now=0.0)
    fair.waits(SMALL, 10.0)
    assert fair.over_share(LARGE, {"long": 9000.0, "short": 1000.0}, 3000, now=1.0) is False


def test_a_share_refusal_is_sent_back_when_its_tenant_frees_and_takes_no_place_in_the_schedule() -> None:
    fair = FairShare()
    kv = KvBudget(4096, booking=BookingMode.LIFETIME, fairness=fair)
    kv.admit("s1", 8, 1000, "short", now=0.0)
    kv.admit("s2", 8, 1000, "short", now=0.0)
    assert kv.would_fit(8, 1800, "long", now=1.0)[0] is False  # 1,808 does not fit in 3,686 - 2,016
    assert fair.holds(ClaimId(0, "long", 1, (8, 1800)), 1.0)
    assert kv.would_fit(8, 50, "short", now=1.5)[0] is False  # the short tenant holds all: over its share
    assert kv.schedule.promises == 0
    assert kv.retry_after(1.5) is None  # no decode pace (lifetime booking): the caller's default hint


def run_with_hints(fair: FairShare | None, seconds: float = 60.0) -> tuple[list[float], float]:
    """The thirty-fold tenants again, each request held 6 s, every refused client back after the budget's
    retry-after (1 s where it has none): the long tenant's share of the KV held per 10 s window, and the KV
    held on average."""
    kv = KvBudget(16_384, booking=BookingMode.LIFETIME, fairness=fair)
    rng = random.Random(7)
    clients = [("short", 100, i) for i in range(64)] + [("long", 3000, i) for i in range(8)]
    rng.shuffle(clients)
    busy: dict[tuple[str, int, int], tuple[float, int]] = {}
    back_at: dict[tuple[str, int, int], float] = {}
    window = {"long": 0.0, "short": 0.0}
    shares, total, now = [], 0.0, 0.0
    while now < seconds:
        for client, (until, _) in list(busy.items()):
            if until <= now:
                kv.release(str(client), 200)
                del busy[client]
        for client in clients:
            if client in busy or back_at.get(client, 0.0) > now:
                continue
            tenant, size, _ = client
            if kv.would_fit(size, 200, tenant, now=now)[0]:
                kv.admit(str(client), size, 200, tenant, now=now)
                busy[client] = (now + 6.0, size + 200)
            else:
                back_at[client] = now + min(60.0, max(1.0, kv.retry_after(now) or 1.0))
        for (tenant, _, _), (_, footprint) in busy.items():
            window[tenant] += footprint * 0.1
            total += footprint * 0.1
        now = round(now + 0.1, 1)
        if abs(now % 10.0) < 1e-9:
            shares.append(window["long"] / (window["long"] + window["short"]))
            window = {"long": 0.0, "short": 0.0}
    return shares, total / seconds


def test_per_ten_second_window_each_tenant_gets_about_half_and_the_cache_stays_full() -> None:
    """Each 10 s window within 40-60 %, at no more than a tenth less KV held than admitting whatever fits:
    a share guard under which two tenants, each over its share by the other's measure, refused each other
    held 38 % less here. (This lifetime-booked model does not show the live stack's early starvation
    that the guard fixed: bench.protection.fairness measures that.)"""
    unfair, held_unfair = run_with_hints(None)
    fair, held_fair = run_with_hints(FairShare())
    assert max(unfair) < 0.5, unfair
    assert all(0.4 <= share <= 0.6 for share in fair), fair
    assert held_fair >= 0.9 * held_unfair, (held_fair, held_unfair)


def test_a_prompt_admitted_on_its_bound_is_served_at_its_exact_count() -> None:
    """A short prompt's byte bound is about twice its count: served at the bound, its tenant had received
    twice its due by the measure that decides which tenant rounds up past its share."""
    fair = FairShare()
    kv = KvBudget(16_384, booking=BookingMode.LIFETIME, fairness=fair)
    kv.admit("a", 500, 300, "short", now=0.0)  # the bound
    assert fair.attained("short", 0.0) == 800
    assert kv.correct_prompt("a", 110, now=0.0)
    assert fair.attained("short", 0.0) == 410
    kv.correct_prompt("a", 100)  # no clock: the service stays as it was
    assert fair.attained("short", 0.0) == 410
    fair.served("short", -10_000, 0.0)
    assert fair.attained("short", 0.0) == 0  # never below nothing


def test_a_tenant_left_far_behind_is_owed_one_large_admission_not_its_whole_deficit() -> None:
    """Bounded lag: behind the most served tenant by at most the largest admission lately, as start-time
    fair queueing starts a flow at the current virtual time; one admission from there and it is level."""
    fair = FairShare()
    for _ in range(10):
        fair.served("short", 3300, now=0.0)
    assert fair.standing("long", 0.0) == 33_000 - 3300  # never served: stands one large admission behind
    assert fair.attained("long", 0.0) == 0  # what it received, as the metrics show it
    assert fair._before(ClaimId(1, "long", 1, (1, 1)), ClaimId(1, "short", 1, (2, 2)), 0.0)
    fair.served("long", 3300, now=0.0)
    assert fair.standing("long", 0.0) == fair.standing("short", 0.0) == 33_000  # level after one
    assert not fair._before(ClaimId(1, "long", 1, (1, 1)), ClaimId(1, "short", 1, (2, 2)), 0.0)


def test_the_most_served_tenant_is_found_again_when_a_correction_lowers_it() -> None:
    fair = FairShare()
    fair.served("a", 1000, now=0.0)
    fair.served("b", 800, now=0.0)
    fair.served("a", -500, now=0.0)  # its prompt counted at its exact count
    assert fair._top is not None and fair._top[:2] == ("b", 800)
    for _ in range(3):
        fair.served("b", 400, now=0.0)
    assert fair.standing("c", 0.0) == 2000 - 1000  # the top's less the largest admission lately
