"""KV-token budget: footprint accounting, learned completion ratio, fit decisions."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from extproc.core.completion_learner import CompletionLearner
from extproc.core.kv_budget import KvBudget


def test_unknown_capacity_always_fits() -> None:
    b = KvBudget()
    assert b.would_fit(10**9, 10**9) == (True, None)
    b.admit("a", 100, 100)
    assert b.demand_tokens == 200
    assert b.headroom_tokens is None and b.capacity_tokens is None
    b.set_capacity(0)
    assert b.capacity_tokens is None


def test_refuses_past_target_utilization() -> None:
    b = KvBudget(10_000, target_utilization=0.9)
    assert b.budget_tokens == 9_000
    b.admit("a", 4_000, 1_000)
    assert b.would_fit(3_000, 1_000) == (True, 4_000)
    assert b.would_fit(3_000, 1_001) == (False, 4_000)
    b.admit("b", 3_000, 1_000)
    assert b.headroom_tokens == 0
    assert b.release("a")
    assert b.demand_tokens == 4_000


def test_empty_pool_admits_an_oversized_request() -> None:
    b = KvBudget(1_000)
    assert b.would_fit(5_000, 5_000) == (True, 900)


def test_progress_never_lowers_and_grows_past_estimate() -> None:
    b = KvBudget(100_000, initial_completion_ratio=0.5, min_completion_ratio=0.05)
    assert b.admit("a", 100, 200) == 200  # 100 prompt + 50% of 200
    b.progress("a", 50)
    assert b.demand_tokens == 200
    b.progress("a", 150)
    assert b.demand_tokens == 250
    b.progress("a", 120)  # cumulative counts never go back
    assert b.demand_tokens == 250
    assert not b.progress("zzz", 10)


def test_release_learns_a_robust_completion_ratio_per_key() -> None:
    learner = CompletionLearner(min_samples=4, quantile=0.9, floor=0.1)
    b = KvBudget(100_000, learner=learner)
    assert b.completion_ratio == 1.0
    for i, used in enumerate((20, 30, 40, 90)):
        b.admit(f"a{i}", 10, 100, "acme")
        b.release(f"a{i}", actual_completion=used)
    assert b.learner.ratio("acme") == pytest.approx(0.9)  # p90 of 0.2, 0.3, 0.4, 0.9
    assert b.expected_completion(100, "acme") == 90
    assert b.expected_completion(100, "other") == 100  # nobody else moved
    b.admit("b", 10, 100, "acme")
    b.release("b")  # cancelled: no sample
    assert b.learner.ratio("acme") == pytest.approx(0.9)


def test_early_stopping_requests_cannot_shrink_another_tenants_footprint() -> None:
    """Forty requests that stop after a few tokens used to drive every 4,000-token booking to 210 tokens."""
    b = KvBudget(1_000_000)
    for i in range(40):
        b.admit(f"x{i}", 10, 4_000, "attacker")
        b.release(f"x{i}", actual_completion=1)
    assert b.admit("victim", 0, 4_000, "victim") == 4_000
    assert b.expected_completion(4_000, "attacker") == 400  # its own estimate stops at the floor


def test_ratio_floor_and_double_release() -> None:
    b = KvBudget(1000, learner=CompletionLearner(min_samples=1, floor=0.1))
    b.admit("a", 1, 100)
    assert b.release("a", actual_completion=0)
    assert b.completion_ratio == pytest.approx(0.1)
    assert not b.release("a", actual_completion=0)
    assert b.demand_tokens == 0


def test_learner_forgets_the_least_recent_keys_and_they_start_safe() -> None:
    learner = CompletionLearner(min_samples=1, max_keys=2)
    for key in ("a", "b", "c"):
        learner.observe(key, 0.2)
    assert learner.keys == 2
    assert learner.ratio("a") == 1.0 and learner.ratio("c") == pytest.approx(0.2)


def test_duplicate_admit_is_rejected() -> None:
    b = KvBudget(1000)
    b.admit("a", 1, 1)
    with pytest.raises(ValueError, match="already admitted"):
        b.admit("a", 1, 1)


def test_capacity_share_and_shrinking_capacity() -> None:
    b = KvBudget(10_000, target_utilization=1.0, capacity_share=0.5)
    assert b.budget_tokens == 5_000
    b.admit("a", 4_000, 0)
    b.set_capacity(2_000)
    assert b.headroom_tokens == -3_000
    assert b.would_fit(1, 0) == (False, -3_000)


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"target_utilization": 0.0}, "target_utilization"),
        ({"capacity_share": 2.0}, "capacity_share"),
        ({"min_completion_ratio": 0.0}, "min_completion_ratio"),
        ({"initial_completion_ratio": 1.5}, "initial_completion_ratio"),
    ],
)
def test_validation(kwargs: dict[str, float], key: str) -> None:
    with pytest.raises(ValueError, match=key):
        KvBudget(1000, **kwargs)


ops = st.lists(
    st.tuples(
        st.sampled_from(["admit", "progress", "release"]),
        st.integers(0, 5),
        st.integers(0, 5000),
        st.integers(0, 5000),
    ),
    max_size=80,
)


@given(ops)
def test_demand_equals_sum_of_live_footprints_and_returns_to_zero(
    seq: list[tuple[str, int, int, int]],
) -> None:
    b = KvBudget(50_000)
    live: set[str] = set()
    for op, idx, x, y in seq:
        lid = f"l{idx}"
        if op == "admit" and lid not in live:
            b.admit(lid, x, y)
            live.add(lid)
        elif op == "progress":
            b.progress(lid, x)
        elif op == "release":
            b.release(lid, y)
            live.discard(lid)
        assert b.demand_tokens >= 0
        assert b.leases == len(live)
        assert 0.1 <= b.completion_ratio <= 1.0
    for lid in list(live):
        b.release(lid)
    assert b.demand_tokens == 0
