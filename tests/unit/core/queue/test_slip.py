"""ForecastSlip: how late capacity came against its forecast, per second of horizon, as a margin."""

from __future__ import annotations

import pytest

from extproc.core.queue.slip import ForecastSlip


def test_the_prior_stands_until_enough_grants_were_seen() -> None:
    slip = ForecastSlip(prior=1.0, min_samples=3, floor_s=0.5)
    assert slip.margin(2.0) == 2.0 and slip.margin(0.1) == 0.5  # the floor: a start due almost at once
    slip.observe(0.0, 1.0, 1.0)
    slip.observe(0.0, 1.0, 1.0)
    assert slip.rate() == 1.0
    slip.observe(0.0, 1.0, 1.0)
    assert slip.rate() == 0.0 and slip.margin(3.0) == 0.0


def test_slips_are_per_second_of_horizon_and_early_counts_as_none() -> None:
    slip = ForecastSlip(min_samples=1, quantile=1.0, floor_s=0.5)
    slip.observe(10.0, 12.0, 11.5)  # early
    assert slip.rate() == 0.0
    slip.observe(10.0, 12.0, 12.2)  # 0.2 s late over 2 s
    assert slip.rate() == pytest.approx(0.1)
    assert slip.margin(4.0) == pytest.approx(0.4)
    slip.observe(10.0, 10.1, 10.2)  # 0.1 s late over 0.1 s: counted over the 0.5 s floor
    assert slip.rate() == pytest.approx(0.2)


def test_the_margin_is_a_high_quantile_of_the_recent_window() -> None:
    slip = ForecastSlip(min_samples=1, quantile=0.9, window=10, floor_s=1.0)
    for late in [0.0] * 9 + [0.5]:
        slip.observe(0.0, 1.0, 1.0 + late)
    assert slip.rate() == 0.0  # one slip in ten is above the 90th percentile
    slip.observe(0.0, 1.0, 1.3)  # the window drops its oldest: two slips in ten
    assert slip.rate() == pytest.approx(0.3)
    for _ in range(10):
        slip.observe(0.0, 1.0, 1.0)
    assert slip.rate() == 0.0  # the window forgets


@pytest.mark.parametrize(
    "kwargs", [{"quantile": 0.0}, {"window": 0}, {"min_samples": 0}, {"floor_s": 0.0}, {"prior": -1.0}]
)
def test_nonsense_settings_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        ForecastSlip(**kwargs)  # type: ignore[arg-type]
