"""When a refused request will fit: the KV budget's forecast of releases and of the places promised to the
requests refused before it (`KvBudget.retry_after`), and the hint a refusal carries."""

from __future__ import annotations

from extproc.admission.replies import refusals
from extproc.core.kv_budget import KvBudget


def budget_at_pace(tokens_per_second: float | None) -> KvBudget:
    budget = KvBudget(capacity_tokens=1000, target_utilization=1.0)
    if tokens_per_second is not None:
        budget.pace.observe_stream(tokens_per_second, 1.0)
    budget.admit("long", 100, 400, now=0.0)  # footprint 500, ends 4 s in at 100 tokens/s
    budget.admit("short", 100, 100, now=0.0)  # footprint 200, ends 1 s in
    return budget


def test_the_first_release_that_frees_enough_comes_first() -> None:
    budget = budget_at_pace(100.0)
    fits, _ = budget.would_fit(100, 300, now=0.0)  # 700 booked + 400 > 1000: 100 too many
    assert not fits
    assert budget.retry_after(0.0) == 1.0  # the short lease's 200 frees enough, for the 3 s it runs


def test_a_release_too_small_is_skipped() -> None:
    budget = budget_at_pace(100.0)
    fits, _ = budget.would_fit(100, 550, now=0.0)  # 250 too many: the short lease's 200 is not enough
    assert not fits
    assert budget.retry_after(0.0) == 4.0


def test_progress_brings_the_release_closer() -> None:
    budget = budget_at_pace(100.0)
    budget.would_fit(100, 300, now=0.5)
    assert budget.retry_after(0.5) == 0.5


def test_no_pace_no_forecast() -> None:
    budget = budget_at_pace(None)
    budget.would_fit(100, 300, now=0.0)
    assert budget.retry_after(0.0) is None


def test_refusal_hint_follows_the_forecast_and_spreads_a_flood() -> None:
    budget = budget_at_pace(100.0)
    waits = []
    for _ in range(3):  # three clients sending the same body
        assert not budget.would_fit(100, 300, now=0.0)[0]
        waits.append(refusals.kv_retry_after(budget, 0.0))
    # The first fits when the short lease ends; the second would not fit beside it, so it is sent to the
    # long lease's end, where the third fits beside it too.
    assert waits == [1.0, 4.0, 4.0]
    headers = dict(refusals.kv_budget("m", 400, 0, waits[1]).headers)
    assert (headers["retry-after"], headers["retry-after-ms"]) == ("4", "4000")


def test_unknown_pace_falls_back_to_the_fixed_hint() -> None:
    budget = budget_at_pace(None)
    budget.would_fit(100, 300, now=0.0)
    assert refusals.kv_retry_after(budget, 0.0) == refusals.KV_RETRY_AFTER_S


def test_hints_are_bounded_by_what_sdks_honour() -> None:
    budget = KvBudget(capacity_tokens=1000, target_utilization=1.0)
    budget.pace.observe_stream(16, 1000.0)  # 0.016 tokens/s: a lease ends in hours
    budget.admit("slow", 100, 800, now=0.0)
    budget.would_fit(100, 300, now=0.0)
    assert refusals.kv_retry_after(budget, 0.0) == 60.0


def test_a_forecast_of_now_is_not_followed_below_a_second() -> None:
    """Leases taken for finished (a pace learned too fast) give an ETA of ~0 for a request just refused."""
    budget = budget_at_pace(100.0)
    budget.would_fit(100, 300, now=10.0)  # 10 s in, at 100 tokens/s both leases should have ended
    assert budget.retry_after(10.0) == 0.0
    assert refusals.kv_retry_after(budget, 10.0) == refusals.KV_RETRY_AFTER_S


def test_a_burst_is_sent_back_in_waves_the_cache_holds() -> None:
    """Forty at once where eight fit: the refused thirty-two are sent to the first release, then to the
    ends of the answers promised before them, eight at a time, not all to the first release."""
    budget = KvBudget(capacity_tokens=800, target_utilization=1.0)
    budget.pace.observe_stream(100, 1.0)  # 100 tokens/s: a 100-token answer runs 1 s
    for index in range(8):
        budget.admit(f"r{index}", 0, 100, now=0.0)
    waits = []
    for _ in range(32):
        assert not budget.would_fit(0, 100, now=0.0)[0]
        waits.append(budget.retry_after(0.0))
    assert waits == [1.0] * 8 + [2.0] * 8 + [3.0] * 8 + [4.0] * 8
    budget.admit("back", 0, 100, now=1.0)  # one of the first wave is admitted: its place is taken
    assert budget.schedule.promises == 31
