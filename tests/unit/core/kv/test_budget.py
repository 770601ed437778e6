"""KV-token budget: footprint accounting, learned completion ratio, fit decisions."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from extproc.core.kv.budget import BookingMode, KvBudget
from extproc.core.kv.completion import CompletionLearner


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
def test_validation(kwargs: dict[str, Any], key: str) -> None:
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


# -- forecast booking ----------------------------------------------------------------------------------------


def forecasting_budget(capacity: int = 10_000, **kwargs: object) -> KvBudget:
    """A forecast budget whose completion estimate is the whole allowance (a bound, never a guess)."""
    learner = CompletionLearner(min_samples=10**6)
    return KvBudget(capacity, target_utilization=1.0, booking=BookingMode.FORECAST, learner=learner, **kwargs)  # type: ignore[arg-type]


def test_without_a_known_pace_a_silent_lease_books_its_whole_footprint() -> None:
    b = forecasting_budget()
    b.observe_engine(0, now=0.0, fresh_for=5.0)
    b.admit("a", 4_000, 2_000, now=0.0)
    b.would_fit(0, 0, now=3.0)
    assert b.booked_tokens == 6_000  # no stream has shown how fast the pool decodes
    assert not b.would_fit(3_000, 1_001, now=3.0)[0]


def test_forecast_needs_a_fresh_engine_sample_else_books_lifetimes() -> None:
    b = forecasting_budget()
    b.admit("a", 4_000, 2_000, now=0.0)
    assert not b.forecasting(0.0)
    assert b.would_fit(3_000, 1_000, now=0.0) == (True, 4_000)
    assert b.would_fit(3_000, 1_001, now=0.0)[0] is False  # 6,000 + 4,001 > 10,000
    b.observe_engine(4_000, now=1.0, fresh_for=5.0)
    assert b.forecasting(1.0) and b.forecasting(6.0) and not b.forecasting(6.01)
    assert not b.forecasting(None)  # callers that pass no clock keep lifetime booking
    # "a" has no observed progress and no pace is known: still its whole footprint, for 2,000 steps.
    assert b.booked_tokens == 6_000


def test_forecast_admits_what_fits_at_every_future_step() -> None:
    b = forecasting_budget()
    b.pace.observe_stream(100, 1.0)  # the pool's decode pace is known
    b.admit("a", 4_000, 2_000, now=0.0)
    b.progress("a", 1_500, now=1.0)  # streamed: 500 tokens to go
    b.observe_engine(5_500, now=1.0, fresh_for=5.0)
    assert b.booked_tokens == 6_000
    # B (3,000 + 1,500): at step 500 A peaks at 6,000 with B at 3,500 = 9,500; then B alone to 4,500.
    # Lifetime booking would have needed 6,000 + 4,500 = 10,500.
    assert b.would_fit(3_000, 1_500, now=1.0)[0]
    assert b.would_fit(3_500, 1_500, now=1.0)[0]  # 6,000 + 4,000 at step 500: exactly the budget
    assert not b.would_fit(3_501, 1_500, now=1.0)[0]
    b.admit("b", 3_000, 1_500, now=1.0)
    assert b.booked_tokens == 9_500
    assert b.demand_tokens == 10_500


def test_engine_kv_the_leases_do_not_explain_is_added_to_forecasts() -> None:
    b = forecasting_budget()
    b.admit("a", 1_000, 1_000, now=0.0)
    b.progress("a", 100, now=0.5)
    b.observe_engine(3_100, now=1.0, fresh_for=5.0)  # 2,000 more than "a" holds (1,100)
    assert b.unexplained_tokens == 2_000
    assert b.booked_tokens == 2_000 + 2_000
    b.observe_engine(500, now=2.0, fresh_for=5.0)  # less than explained: never subtracted
    assert b.unexplained_tokens == 0
    b.observe_engine(None, now=3.0, fresh_for=5.0)  # no usage published: nothing to add
    assert b.unexplained_tokens == 0 and b.forecasting(3.0)


def test_unexplained_kv_counts_by_this_replicas_share() -> None:
    b = forecasting_budget(capacity_share=0.5)
    b.admit("a", 1_000, 0, now=0.0)
    b.observe_engine(4_000, now=0.0, fresh_for=5.0)  # two replicas: half of 4,000 is ours, 1,000 explained
    assert b.unexplained_tokens == 1_000


def test_pace_from_streams_estimates_answers_that_do_not_stream() -> None:
    b = forecasting_budget(100_000)
    b.observe_engine(0, now=0.0, fresh_for=100.0)
    b.admit("stream", 100, 1_000, now=0.0)
    b.progress("stream", 1, now=0.25)  # first token after 0.25 s
    b.progress("stream", 101, now=1.25)  # 100 tokens per second
    assert b.release("stream", 101)
    assert b.pace.tokens_per_second == pytest.approx(100.0)
    assert b.pace.first_token_delay == pytest.approx(0.25)
    b.admit("json", 1_000, 1_000, now=10.0)
    b.would_fit(0, 0, now=12.25)
    # Two seconds of decoding: 200 of 1,000 tokens, 800 steps to go: peak 1,000 + 1,000.
    assert b.booked_tokens == 2_000
    b.would_fit(0, 0, now=10.0)
    assert b.booked_tokens == 2_000  # the same peak, reached later
    # Past its expected completion (here the whole allowance): it stays counted, at its allowance.
    b.would_fit(0, 0, now=30.0)
    assert b.booked_tokens == 2_000


def test_a_lease_past_its_estimate_is_reforecast_to_its_allowance() -> None:
    learner = CompletionLearner(min_samples=1, prior=1.0)
    b = KvBudget(100_000, target_utilization=1.0, booking=BookingMode.FORECAST, learner=learner)
    b.admit("x", 0, 100, now=0.0)
    b.release("x", 20)  # the learned ratio is now 0.2
    b.observe_engine(0, now=0.0, fresh_for=100.0)
    b.admit("a", 1_000, 1_000, now=0.0)
    b.progress("a", 100, now=1.0)
    b.would_fit(0, 0, now=1.0)
    assert b.booked_tokens == 1_000 + 200  # expected 200 tokens
    b.progress("a", 250, now=2.0)
    b.would_fit(0, 0, now=2.0)
    assert b.booked_tokens == 1_000 + 1_000  # beyond its estimate: up to its allowance


def test_lifetime_booking_ignores_engine_samples() -> None:
    b = KvBudget(10_000, target_utilization=1.0)
    b.admit("a", 1_000, 1_000, now=0.0)
    b.observe_engine(9_000, now=0.0, fresh_for=5.0)
    assert not b.forecasting(0.0)
    assert b.would_fit(8_000, 0, now=0.0) == (True, 8_000)


class ForecastEngine(RuleBasedStateMachine):
    """A decoding engine in front of a forecast budget: every running request gains one token per step and
    ends at its true completion, never above its allowance. Admitting only what `would_fit` accepts must
    keep the KV really held within the budget at every step: the guarantee that replaces preemption."""

    def __init__(self) -> None:
        super().__init__()
        self.budget = forecasting_budget(20_000)
        # One step = 10 ms: the pace the pool showed before (100 tokens per second per sequence).
        self.budget.pace.observe_stream(100, 1.0)
        self.now = 0.0
        self.budget.observe_engine(0, now=self.now, fresh_for=1_000.0)
        self.running: dict[str, tuple[int, int, int]] = {}  # id -> (prompt, generated, true completion)
        self.next_id = 0

    @rule(
        requests=st.lists(
            st.tuples(st.integers(0, 6_000), st.integers(1, 3_000), st.floats(0.0, 1.0)),
            min_size=1,
            max_size=6,
        )
    )
    def arrive(self, requests: list[tuple[int, int, float]]) -> None:
        for prompt, allowance, used in requests:
            if prompt + allowance > 20_000:  # admitted into an empty pool by design
                continue
            fits, _ = self.budget.would_fit(prompt, allowance, now=self.now)
            if not fits:
                continue
            lease = f"r{self.next_id}"
            self.next_id += 1
            self.budget.admit(lease, prompt, allowance, now=self.now)
            self.running[lease] = (prompt, 0, max(1, round(allowance * used)))

    @rule(steps=st.integers(1, 400))
    def decode(self, steps: int) -> None:
        for _ in range(steps):
            self.now += 0.01
            for lease, (prompt, done, total) in list(self.running.items()):
                done += 1
                self.budget.progress(lease, done, now=self.now)
                if done >= total:
                    del self.running[lease]
                    self.budget.release(lease, done)
                else:
                    self.running[lease] = (prompt, done, total)
            self.check_kv()

    @rule()
    def sample(self) -> None:
        held = sum(prompt + done for prompt, done, _ in self.running.values())
        self.budget.observe_engine(held, now=self.now, fresh_for=1_000.0)

    @invariant()
    def check_kv(self) -> None:
        assert self.budget.forecasting(self.now)
        held = sum(prompt + done for prompt, done, _ in self.running.values())
        assert held <= 20_000


ForecastEngine.TestCase.settings = settings(max_examples=60, stateful_step_count=25, deadline=None)
test_forecast_never_lets_kv_exceed_the_budget = ForecastEngine.TestCase


def test_admit_after_a_decision_books_the_peak_that_decision_computed() -> None:
    b = forecasting_budget()
    b.pace.observe_stream(100, 1.0)
    b.observe_engine(0, now=0.0, fresh_for=5.0)
    b.admit("a", 4_000, 2_000, now=0.0)
    b.progress("a", 1_500, now=1.0)
    assert b.would_fit(3_000, 1_500, now=1.0)[0]
    b.admit("b", 3_000, 1_500, now=1.0)
    assert b.booked_tokens == 9_500
    # Something changed in between (a stream progressed): the admission recomputes.
    assert b.would_fit(100, 100, now=1.0)[0]
    b.progress("b", 900, now=1.0)  # "b" now streams: 3,900 growing to 4,500 at step 600
    b.admit("c", 100, 100, now=1.0)
    booked = b.booked_tokens
    assert booked == 6_000 + 4_400  # at step 500 "c" has ended: "a" 6,000 + "b" 4,400
    b.would_fit(0, 0, now=1.0)  # an independent evaluation agrees
    assert b.booked_tokens == booked


def test_reported_streams_teach_the_pace_of_a_budget_that_sees_no_stream() -> None:
    """The lean profile: nothing streams through the sidecar; end reports bring each stream's timing."""
    b = forecasting_budget()
    b.observe_engine(0, now=0.0, fresh_for=100.0)
    b.admit("a", 4_000, 2_000, now=0.0)
    b.would_fit(0, 0, now=5.25)
    assert b.booked_tokens == 6_000  # no pace yet: the whole footprint
    b.observe_unseen_stream(first_token_after_s=0.25, tokens_per_sequence=400, seconds=4.0)
    assert b.pace.tokens_per_second == pytest.approx(100.0)
    assert b.pace.first_token_delay == pytest.approx(0.25)
    # 5 s of decoding at 100 tokens/s: 500 generated, 1,500 steps to go; alone, it peaks at its end.
    b.would_fit(0, 0, now=5.25)
    assert b.booked_tokens == 6_000
    # A second request fits where lifetime booking (6,000 + 4,200 > 10,000) refuses it: "b" (3,000 +
    # 1,200) peaks at step 1,200 with "a" at 5,700 (9,900), and "a" peaks at step 1,500 alone.
    assert b.would_fit(3_000, 1_200, now=5.25)[0]
    assert not b.would_fit(3_000, 1_200)[0]


def test_an_estimate_of_unseen_progress_grows_the_footprint_but_not_the_forecast_progress() -> None:
    b = forecasting_budget()
    b.observe_engine(0, now=0.0, fresh_for=100.0)
    b.observe_unseen_stream(0.5, 100, 1.0)  # 100 tokens/s after 0.5 s
    b.admit("a", 1_000, 1_000, now=0.0)
    # The caller's charge estimate counts from admission (errs high): 900 tokens after 9 s.
    assert b.estimate_progress("a", 900)
    assert b.demand_tokens == 2_000  # within the expected completion: the footprint is unchanged
    b.would_fit(0, 0, now=1.0)
    assert b.booked_tokens == 2_000  # the forecast keeps its own estimate: 50 tokens, 950 steps to go
    assert b.estimate_progress("a", 1_200)  # past what it was expected to generate
    assert b.demand_tokens == 2_200
    assert not b.estimate_progress("gone", 1)


# -- leases the engine has finished --------------------------------------------------------------------------


def slow_readers() -> KvBudget:
    """Two answers nobody sees (lean), 100 prompt + 2,000 allowed each, admitted at 0 and 1 and counted
    running at 2; the pool's pace known (100 tokens per second), so "b" is less far into its answer than "a"
    at any time."""
    b = forecasting_budget(100_000)
    b.pace.observe_stream(100, 1.0)
    b.observe_engine(0, now=0.0, fresh_for=100.0, waiting=0, running=0)
    b.admit("a", 100, 2_000, now=0.0)
    b.admit("b", 100, 2_000, now=1.0)
    b.observe_engine(400, now=2.0, fresh_for=100.0, waiting=0, running=2)
    return b


def test_a_lease_the_engine_finished_is_booked_nothing_while_its_client_reads() -> None:
    """The engine runs one sequence of the two leases settled in it and nothing waits: one is done, the one
    furthest into its answer; it books nothing (its demand too) until the next sample."""
    b = slow_readers()
    b.observe_engine(2_100, now=30.0, fresh_for=5.0, waiting=0, running=1)
    assert b.engine_finished == 1
    assert b.demand_tokens == 2_100  # "b" alone
    assert b.booked_tokens == 2_100
    b.observe_engine(4_200, now=31.0, fresh_for=5.0, waiting=0, running=2)  # both run after all
    assert b.engine_finished == 0
    assert b.booked_tokens == 4_200


@pytest.mark.parametrize(
    ("waiting", "running"),
    [(1, 1), (None, 1), (0, None), (0, 2), (0, 5)],
    ids=["something-waits", "queue-unknown", "running-unknown", "both-run", "others-run-too"],
)
def test_no_lease_counts_as_finished_unless_the_engine_says_so(
    waiting: float | None, running: float | None
) -> None:
    b = slow_readers()
    b.observe_engine(4_200, now=30.0, fresh_for=5.0, waiting=waiting, running=running)
    assert b.engine_finished == 0
    assert b.booked_tokens == 4_200


def test_a_lease_nobody_sees_is_not_finished_before_the_engine_counted_it_running() -> None:
    """Admitted while the engine runs nothing, and nothing runs sample after sample: the request may still
    be in the engine's API server or on its way there. It is booked in full until a sample counts it."""
    b = forecasting_budget(100_000)
    b.pace.observe_stream(100, 1.0)
    b.observe_engine(0, now=0.0, fresh_for=100.0, waiting=0, running=0)
    b.admit("late", 100, 2_000, now=0.0)
    for now in (10.0, 20.0, 30.0):
        b.observe_engine(0, now=now, fresh_for=5.0, waiting=0, running=0)
        assert b.engine_finished == 0 and b.demand_tokens == 2_100
    b.observe_engine(300, now=31.0, fresh_for=5.0, waiting=0, running=1)
    b.observe_engine(0, now=40.0, fresh_for=5.0, waiting=0, running=0)
    assert b.engine_finished == 1 and b.demand_tokens == 0


def test_a_stream_still_progressing_or_a_fresh_lease_never_counts_as_finished() -> None:
    """A streamed answer seen progressing is running (what the engine does is seen), and a lease admitted
    less than `settle_after` ago may not be in the engine's count yet."""
    b = slow_readers()
    b.progress("a", 50, now=2.0)
    b.progress("a", 2_000, now=29.5)
    b.admit("c", 100, 2_000, now=29.5)
    b.observe_engine(4_200, now=30.0, fresh_for=5.0, waiting=0, running=0)
    assert b.engine_finished == 1  # "b" only
    assert b.demand_tokens == 2 * 2_100


def test_a_stream_stalled_behind_its_slow_reader_counts_as_finished() -> None:
    """The inline profile sees a slow reader's answer at its client's pace: a stream whose progress stopped
    `settle_after` ago or more is the first taken as finished when the engine runs fewer sequences than the
    leases settled in it."""
    b = slow_readers()
    b.progress("a", 50, now=2.0)  # stalled since 2 s: the proxy's buffers are full
    b.observe_engine(0, now=30.0, fresh_for=5.0, waiting=0, running=0)
    assert b.engine_finished == 2  # "b", whose progress nobody sees, and the stalled stream "a"
    assert b.demand_tokens == 0
    b.progress("a", 60, now=30.5)  # it moves again, and the engine runs both
    b.observe_engine(4_200, now=31.0, fresh_for=5.0, waiting=0, running=2)
    assert b.engine_finished == 0


def test_n_sequences_count_as_n_of_the_engines_running_requests() -> None:
    b = forecasting_budget(100_000)
    b.pace.observe_stream(100, 1.0)
    b.observe_engine(0, now=0.0, fresh_for=100.0, waiting=0, running=0)
    b.admit("n8", 100, 8 * 200, now=0.0, sequences=8)
    b.observe_engine(1_000, now=29.0, fresh_for=5.0, waiting=0, running=8)
    b.observe_engine(1_000, now=30.0, fresh_for=5.0, waiting=0, running=7)  # one of its eight ended
    assert b.engine_finished == 0  # never more sequences than the engine says are done
    b.observe_engine(0, now=31.0, fresh_for=5.0, waiting=0, running=0)
    assert b.engine_finished == 1


# -- unconfirmed credit (core/kv/credit.py) ------------------------------------------------------------------


def poisoned(unconfirmed_share: float = 0.1) -> KvBudget:
    """`make run`'s 16,384-token cache at 0.9, its tenant trained to stop after one token of 4,000."""
    b = KvBudget(16_384, target_utilization=0.9, unconfirmed_share=unconfirmed_share)
    for i in range(40):
        b.admit(f"t{i}", 20, 4_000, "mallory")
        b.release(f"t{i}", 1)
    assert b.completion_ratio == 1.0 and b.learner.ratio("mallory") == 0.1
    return b


def burst(b: KvBudget, count: int = 12) -> list[str]:
    admitted = []
    for i in range(count):
        if b.would_fit(20, 4_000, "mallory")[0]:
            b.admit(f"b{i}", 20, 4_000, "mallory")
            admitted.append(f"b{i}")
    return admitted


def test_a_tenant_trained_short_cannot_burst_past_the_cache() -> None:
    b = poisoned()
    admitted = burst(b)
    # Before the credit's bound: all 12 booked 420 each; run to the end, 48,240 tokens in a 16,384 cache.
    assert len(admitted) == 4
    assert len(admitted) * (20 + 4_000) <= 16_384
    assert b.credit.held("mallory") <= int(16_384 * 0.1)


@pytest.mark.parametrize("pace_known", [True, False])
def test_a_forecast_does_not_free_a_trained_down_request_before_its_allowance(pace_known: bool) -> None:
    """The engine tier's burst (tests/engine/test_poison_engine.py): 1,500-token streams trained to stop at
    150. Forecast to end at its learned 150 (and the next at 1,212, where the credit ran out), the first two
    freed their footprints from the forecast before the others peaked, and eleven were admitted where ten
    fit: run to their allowances, 16,720 tokens of 16,384, a preemption in CI. Held at their expected size
    until their allowances' end, they leave room for eight more, as lifetime booking does. (Without a known
    pace every lease is booked flat at its final size, and the peak is where all are present either way.)"""
    b = KvBudget(16_384, target_utilization=0.9, booking=BookingMode.FORECAST)
    for i in range(40):
        b.admit(f"t{i}", 20, 1_500, "mallory")
        b.release(f"t{i}", 1)
    if pace_known:
        b.pace.observe_stream(100, 1.0)
    b.observe_engine(0, now=0.0, fresh_for=5.0, waiting=0, running=0)
    admitted = 0
    for i in range(12):
        if b.would_fit(20, 1_500, "mallory", now=0.0)[0]:
            b.admit(f"b{i}", 20, 1_500, "mallory", now=0.0)
            admitted += 1
    assert admitted == 10
    assert admitted * (20 + 1_500) <= 16_384


def test_credit_comes_back_with_the_release_and_an_honest_short_request_keeps_it() -> None:
    b = poisoned()
    b.admit("short", 20, 1_000, "mallory")  # credit 900 of the 1,638 a tenant may hold
    assert b.demand_tokens == 20 + 100
    b.admit("long", 20, 4_000, "mallory")  # 738 of credit left: booked 3,262
    assert b.demand_tokens == 120 + 20 + 3_262
    b.release("short", 1)
    b.release("long", 1)
    assert b.credit.held("mallory") == 0
    b.admit("again", 20, 1_000, "mallory")
    assert b.demand_tokens == 120  # the learned share again


def test_another_tenants_credit_is_its_own() -> None:
    b = poisoned()
    burst(b, 2)
    for _i in range(8):
        b.learner.observe("alice", 0.1)
    b.admit("a", 20, 1_000, "alice")
    assert b.credit.held("alice") == 900


def test_no_credit_bound_can_be_configured_and_a_bad_one_is_refused() -> None:
    assert len(burst(poisoned(unconfirmed_share=1.0))) > 4
    with pytest.raises(ValueError, match="unconfirmed_share"):
        KvBudget(1_000, unconfirmed_share=1.5)
