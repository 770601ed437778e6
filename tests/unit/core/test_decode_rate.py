"""The pool decode rate that bounds the charge of answers nobody saw."""

from __future__ import annotations

import math

import pytest

from extproc.core.decode_rate import DecodeRates


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
