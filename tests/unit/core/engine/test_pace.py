"""The learned pace, and the pools' paces that bound the charge of answers nobody saw."""

from __future__ import annotations

import math

import pytest

from extproc.core.engine.pace import (
    LearnedPace,
    PoolPaces,
    RateSource,
    bounded_by_engines,
    hint_pace,
    lockstep_floor,
    usable_rate,
)


def test_default_until_observed_then_ewma() -> None:
    rates = PoolPaces(default_tokens_per_second=100.0, alpha=0.5)
    assert rates.rate("p") == 100.0
    rates.observe("p", 200, 4.0)  # 50 tok/s: the first sample is taken as is
    assert rates.rate("p") == pytest.approx(50.0)
    rates.observe("p", 300, 2.0)  # 150 tok/s
    assert rates.rate("p") == pytest.approx(100.0)
    assert rates.rate("q") == 100.0  # per pool


@pytest.mark.parametrize(("tokens", "seconds"), [(5, 1.0), (100, 0.0), (100, -1.0), (100, math.inf)])
def test_noisy_or_broken_samples_are_ignored(tokens: float, seconds: float) -> None:
    rates = PoolPaces(default_tokens_per_second=80.0)
    rates.observe("p", tokens, seconds)
    assert rates.rate("p") == 80.0 and rates.pools == 0


def test_estimate_is_elapsed_times_rate_times_sequences_capped_by_the_reservation() -> None:
    rates = PoolPaces(default_tokens_per_second=152.0)
    assert rates.estimate("p", 3.0, 1, 2000) == 456  # three seconds into a 2,000-token answer
    assert rates.estimate("p", 3.0, 2, 2000) == 912
    assert rates.estimate("p", 60.0, 1, 2000) == 2000
    assert rates.estimate("p", 0.0, 1, 2000) == 0
    assert rates.estimate("p", 1.0, 1, 0) == 0


def test_order_is_learned_then_fed_then_assumed() -> None:
    fed: dict[str, float | None] = {"p": 20.0}
    rates = PoolPaces(default_tokens_per_second=100.0, fed=fed.get)
    assert (rates.rate("p"), rates.source("p")) == (20.0, RateSource.FED)  # no stream completed yet
    assert (rates.rate("q"), rates.source("q")) == (100.0, RateSource.ASSUMED)  # the feed knows no pace
    assert not rates.learned("p")  # the fed pace is not the pool's own: the streamed-cut floor ignores it
    rates.observe("p", 400, 10.0)  # a completed stream: 40 tok/s
    assert (rates.rate("p"), rates.source("p")) == (40.0, RateSource.LEARNED)  # learned wins over fed
    assert rates.learned("p")


@pytest.mark.parametrize("bad", [None, 0.0, -5.0, math.nan, math.inf])
def test_a_fed_value_that_is_no_pace_falls_to_the_assumption(bad: float | None) -> None:
    rates = PoolPaces(default_tokens_per_second=100.0, fed=lambda pool: bad)
    assert (rates.rate("p"), rates.source("p")) == (100.0, RateSource.ASSUMED)


def test_an_expired_lease_is_charged_at_the_fed_pace() -> None:
    """60 s of a lease whose end never came, on an engine running 20 tok/s per sequence: 1,200, not 6,000."""
    rates = PoolPaces(default_tokens_per_second=100.0, fed=lambda pool: 20.0)
    assert rates.estimate("p", 60.0, 1, 10_000) == 1200


def test_a_sample_counts_at_most_max_step_times_the_current_rate() -> None:
    """An answer delivered in a burst (2,000 tokens in 10 ms after the proxy held them) is no decode rate: it
    moves the pool's rate by at most `max_step` of it, whose first rate is then the assumption's multiple."""
    rates = PoolPaces(default_tokens_per_second=100.0, alpha=0.5, max_step=4.0)
    rates.observe("p", 2000, 0.01)  # "200,000 tok/s"
    assert rates.rate("p") == pytest.approx(400.0)
    rates.observe("p", 100, 1.0)  # a real sample pulls it back
    assert rates.rate("p") == pytest.approx(250.0)
    rates.observe("p", 300, 0.1)  # 3,000 tok/s: at most 4 x 250
    assert rates.rate("p") == pytest.approx(625.0)


@pytest.mark.parametrize(
    ("seen", "sequences", "cap", "floor"),
    [
        (10, 8, 192, 16),  # the first step of all eight and two of the second: two steps of each
        (122, 122, 2928, 122),  # the first token of every one
        (123, 122, 2928, 244),
        (5, 1, 100, 5),  # one sequence: what passed
        (0, 8, 192, 0),
        (190, 8, 192, 192),  # never past the reservation
    ],
)
def test_the_lockstep_floor_counts_whole_steps_of_all_sequences(
    seen: int, sequences: int, cap: int, floor: int
) -> None:
    assert lockstep_floor(seen, sequences, cap) == floor


def test_hints_take_the_slower_of_the_learned_and_the_fed_pace() -> None:
    """A pace learned from answers decoded at low load runs fast under the batch a refused client waits
    behind: the retry hints take the engines' own where it is slower, and the usual rate otherwise."""
    fed: dict[str, float | None] = {"p": None}
    rates = PoolPaces(default_tokens_per_second=100.0, fed=lambda pool: fed[pool])
    assert rates.hint_rate("p") == 100.0  # nothing known: assumed
    fed["p"] = 40.0
    assert rates.hint_rate("p") == 40.0  # fed
    rates.observe("p", 160.0, 1.0)
    assert rates.rate("p") == 160.0 and rates.hint_rate("p") == 40.0  # learned fast, the engines slower
    fed["p"] = 400.0
    assert rates.hint_rate("p") == 160.0  # the learned pace is the slower one
    fed["p"] = None
    assert rates.hint_rate("p") == 160.0


def test_pace_is_unknown_until_a_stream_is_seen() -> None:
    pace = LearnedPace()
    assert pace.tokens_per_second is None
    assert pace.tokens_since(0.0, 10.0, 1) is None
    pace.observe_stream(10, 1.0)  # too short to time
    assert pace.tokens_per_second is None
    pace.observe_stream(100, 2.0)
    assert pace.tokens_per_second == 50.0
    pace.observe_stream(200, 2.0)
    assert pace.tokens_per_second == pytest.approx(0.8 * 50 + 0.2 * 100)


def test_pace_estimates_progress_after_the_first_token_delay() -> None:
    pace = LearnedPace(alpha=1.0)
    pace.observe_stream(100, 1.0)
    pace.observe_first_token(0.5)
    assert pace.first_token_delay == 0.5
    assert pace.tokens_since(10.0, 10.4, 1) == 0.0  # still waiting for its first token
    assert pace.tokens_since(10.0, 12.5, 1) == pytest.approx(200.0)
    assert pace.tokens_since(10.0, 12.5, 3) == pytest.approx(600.0)  # three sequences in parallel


def test_pace_ignores_bad_timings_and_validates() -> None:
    pace = LearnedPace()
    pace.observe_stream(100, 0.0)
    pace.observe_stream(100, math.inf)
    pace.observe_first_token(-1.0)
    pace.observe_first_token(math.nan)
    assert pace.tokens_per_second is None and pace.first_token_delay == 0.0
    with pytest.raises(ValueError, match="alpha"):
        LearnedPace(alpha=0.0)


def test_a_learned_sample_is_taken_at_most_at_its_ceiling() -> None:
    pace = LearnedPace(alpha=0.5)
    pace.observe_stream(2000, 0.01, ceiling=400.0)
    assert pace.tokens_per_second == 400.0
    pace.observe_stream(100, 1.0, ceiling=1600.0)
    assert pace.tokens_per_second == pytest.approx(250.0)


def test_forecasts_and_hints_take_the_slower_of_learned_and_fed_by_one_rule() -> None:
    """The KV budget and the pools' paces share these: a pace learned at low load, bounded by the engines'."""
    assert bounded_by_engines(None, 40.0) is None  # nothing learned: the forecast books whole footprints
    assert bounded_by_engines(160.0, None) == 160.0
    assert bounded_by_engines(160.0, 40.0) == 40.0
    assert hint_pace(None, None, None) is None
    assert hint_pace(None, None, 25.0) == 25.0
    assert hint_pace(None, 40.0, 25.0) == 40.0
    assert hint_pace(160.0, 40.0, 25.0) == 40.0
    assert hint_pace(30.0, 40.0, 25.0) == 30.0


@pytest.mark.parametrize("bad", [None, 0.0, -5.0, math.nan, math.inf, -math.inf])
def test_one_validity_rule_reads_every_pace_the_sidecar_did_not_learn(bad: float | None) -> None:
    assert usable_rate(bad) is None
    assert usable_rate(0.5) == 0.5
