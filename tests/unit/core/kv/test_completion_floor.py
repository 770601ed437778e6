"""A tenant cannot train its own forecast down to under-book the requests that say they will run long."""

from __future__ import annotations

from extproc.core.kv.budget import BookingMode, KvBudget
from extproc.core.kv.completion import CompletionLearner

ALLOWANCE = 4000


def trained_down(booking: BookingMode = BookingMode.LIFETIME, unconfirmed_share: float = 0.1) -> KvBudget:
    """A budget whose tenant `mallory` finished 40 requests after 1 of 4,000 allowed tokens each."""
    budget = KvBudget(100_000, target_utilization=1.0, booking=booking, unconfirmed_share=unconfirmed_share)
    for i in range(40):
        budget.admit(f"short{i}", 10, ALLOWANCE, "mallory")
        budget.release(f"short{i}", actual_completion=1)
    return budget


def test_short_answers_teach_the_tenant_ratio_down_to_the_floor() -> None:
    budget = trained_down()
    assert budget.learner.ratio("mallory") == budget.learner.floor == 0.1
    assert budget.expected_completion(ALLOWANCE, "mallory") == 400
    assert budget.expected_completion(ALLOWANCE, "alice") == ALLOWANCE  # other tenants are not moved


def test_a_request_that_declares_its_whole_allowance_is_booked_whole() -> None:
    """`ignore_eos` commits the whole bound: the learned 10 % must not book it at 400 tokens."""
    budget = trained_down()
    assert budget.expected_completion(ALLOWANCE, "mallory", committed=ALLOWANCE) == ALLOWANCE
    charged = budget.admit("long", 10, ALLOWANCE, "mallory", committed=ALLOWANCE)
    assert charged == 10 + ALLOWANCE
    assert budget.demand_tokens == 10 + ALLOWANCE


def test_min_tokens_floors_the_booking_at_what_it_declares() -> None:
    budget = trained_down()
    assert budget.expected_completion(ALLOWANCE, "mallory", committed=2500) == 2500
    assert (
        budget.expected_completion(ALLOWANCE, "mallory", committed=100) == 400
    )  # the learned share is higher
    assert (
        budget.expected_completion(ALLOWANCE, "mallory", committed=10**9) == ALLOWANCE
    )  # never past the bound


def test_the_declared_floor_decides_admission_under_both_bookings() -> None:
    """Capacity 5,000, 4,100 booked: a trained-down 4,000-token request fits only if it is under-booked
    (its whole credit allowed here: `unconfirmed_share` 1; test_kv_budget.py bounds it)."""
    for booking in (BookingMode.LIFETIME, BookingMode.FORECAST):
        budget = trained_down(booking, unconfirmed_share=1.0)
        budget.set_capacity(5000)
        budget.admit("held", 100, ALLOWANCE, "alice", now=0.0)
        fits, _ = budget.would_fit(10, ALLOWANCE, "mallory", now=0.0)
        assert fits, booking  # the learned 10 % books 400 tokens: it fits
        fits, _ = budget.would_fit(10, ALLOWANCE, "mallory", now=0.0, committed=ALLOWANCE)
        assert not fits, booking


def test_a_decision_with_a_different_floor_is_not_reused_by_admit() -> None:
    """admit() reuses the sum of the decision just made only for the same request, floor included."""
    budget = trained_down()
    budget.would_fit(10, ALLOWANCE, "mallory")
    budget.admit("long", 10, ALLOWANCE, "mallory", committed=ALLOWANCE)
    assert budget.booked_tokens == 10 + ALLOWANCE


def test_the_learner_floor_is_a_ratio_of_the_allowance() -> None:
    learner = CompletionLearner(floor=0.25, prior=1.0, min_samples=1)
    learner.observe("k", 0.0)
    assert learner.ratio("k") == 0.25
