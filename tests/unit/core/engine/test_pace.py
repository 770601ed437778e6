"""The pool decode rate that bounds the charge of answers nobody saw."""

from __future__ import annotations

import math

import pytest

from extproc.core.engine.pace import DecodeRates, RateSource, lockstep_floor


def test_default_until_observed_then_ewma() -> None:
    rates = DecodeRates(default_tokens_per_second=100.0, alpha=0.5)
    assert rates.rate("p") == 100.0
    rates.observe("p", 200, 4.0)  # 50 tok/s: the first sample is taken as is
    assert rates.rate("p") == pytest.approx(50.0)
    rates.observe("p", 300, 2.0)  # 150 tok/s
    assert rates.rate("p") == pytest.approx(100.0)
    assert rates.rate("q") == 100.0  # per pool


@pytest.mark.parametrize(("tokens", "seconds"), [(5, 1.0), (100, 0.0), (100, -1.0), (100, math.inf)])
def test_noisy_or_broken_samples_are_ignored(tokens: float, seconds: float) -> None:
    rates = DecodeRates(default_tokens_per_second=80.0)
    rates.observe("p", tokens, seconds)
    assert rates.rate("p") == 80.0 and rates.pools == 0


def test_estimate_is_elapsed_times_rate_times_sequences_capped_by_the_reservation() -> None:
    rates = DecodeRates(default_tokens_per_second=152.0)
    assert rates.estimate("p", 3.0, 1, 2000) == 456  # three seconds into a 2,000-token answer
    assert rates.estimate("p", 3.0, 2, 2000) == 912
    assert rates.estimate("p", 60.0, 1, 2000) == 2000
    assert rates.estimate("p", 0.0, 1, 2000) == 0
    assert rates.estimate("p", 1.0, 1, 0) == 0


def test_order_is_learned_then_fed_then_assumed() -> None:
    fed: dict[str, float | None] = {"p": 20.0}
    rates = DecodeRates(default_tokens_per_second=100.0, fed=fed.get)
    assert (rates.rate("p"), rates.source("p")) == (20.0, RateSource.FED)  # no stream completed yet
    assert (rates.rate("q"), rates.source("q")) == (100.0, RateSource.ASSUMED)  # the feed knows no pace
    assert not rates.learned("p")  # the fed pace is not the pool's own: the streamed-cut floor ignores it
    rates.observe("p", 400, 10.0)  # a completed stream: 40 tok/s
    assert (rates.rate("p"), rates.source("p")) == (40.0, RateSource.LEARNED)  # learned wins over fed
    assert rates.learned("p")


@pytest.mark.parametrize("bad", [None, 0.0, -5.0, math.nan, math.inf])
def test_a_fed_value_that_is_no_pace_falls_to_the_assumption(bad: float | None) -> None:
    rates = DecodeRates(default_tokens_per_second=100.0, fed=lambda pool: bad)
    assert (rates.rate("p"), rates.source("p")) == (100.0, RateSource.ASSUMED)


def test_an_expired_lease_is_charged_at_the_fed_pace() -> None:
    """60 s of a lease whose end never came, on an engine running 20 tok/s per sequence: 1,200, not 6,000."""
    rates = DecodeRates(default_tokens_per_second=100.0, fed=lambda pool: 20.0)
    assert rates.estimate("p", 60.0, 1, 10_000) == 1200


def test_a_sample_counts_at_most_max_step_times_the_current_rate() -> None:
    """An answer delivered in a burst (2,000 tokens in 10 ms after the proxy held them) is no decode rate: it
    moves the pool's rate by at most `max_step` of it, whose first rate is then the assumption's multiple."""
    rates = DecodeRates(default_tokens_per_second=100.0, alpha=0.5, max_step=4.0)
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
    rates = DecodeRates(default_tokens_per_second=100.0, fed=lambda pool: fed[pool])
    assert rates.hint_rate("p") == 100.0  # nothing known: assumed
    fed["p"] = 40.0
    assert rates.hint_rate("p") == 40.0  # fed
    rates.observe("p", 160.0, 1.0)
    assert rates.rate("p") == 160.0 and rates.hint_rate("p") == 40.0  # learned fast, the engines slower
    fed["p"] = 400.0
    assert rates.hint_rate("p") == 160.0  # the learned pace is the slower one
    fed["p"] = None
    assert rates.hint_rate("p") == 160.0
