"""The engines' step time against their batch (`extproc.core.engine.steps`): the pace a batch of another size
runs at, from the paces the feed read at two sizes or more."""

from __future__ import annotations

import math

import pytest

from extproc.core.engine.steps import StepTimes


def steps_of(fixed: float, per_sequence: float, *batches: float) -> StepTimes:
    """Readings of an engine whose step takes `fixed + per_sequence x batch` seconds."""
    steps = StepTimes()
    for batch in batches:
        steps.observe(1.0 / (fixed + per_sequence * batch), batch)
    return steps


def test_one_batch_size_says_nothing_of_another() -> None:
    assert StepTimes().pace_at(8) is None
    assert steps_of(0.01, 0.001, 48, 40, 33).pace_at(8) is None  # 32-63: one band


def test_a_cpu_like_engine_runs_a_smaller_batch_faster_in_proportion() -> None:
    """Steps in proportion to the batch (the CPU engine of the real-engine tier): a pace read at 48 is 48/33
    of itself at 33."""
    steps = steps_of(0.0, 0.00125, 48, 1)
    assert steps.pace_at(33) == pytest.approx(1.0 / (0.00125 * 33))
    assert steps.pace_at(48) == pytest.approx(1.0 / (0.00125 * 48))


def test_a_gpu_like_engine_runs_every_small_batch_at_about_the_same_pace() -> None:
    steps = steps_of(0.02, 0.00005, 1, 16, 64)
    assert steps.pace_at(8) == pytest.approx(1.0 / (0.02 + 0.00005 * 8))
    assert steps.pace_at(200) == pytest.approx(1.0 / (0.02 + 0.00005 * 200))


def test_steps_that_shrink_with_the_batch_are_taken_as_constant() -> None:
    """Noise can make a larger batch read faster: no pace rises with the batch, the steps' mean is taken."""
    steps = StepTimes()
    steps.observe(40.0, 2)  # 25 ms
    steps.observe(50.0, 40)  # 20 ms
    assert steps.pace_at(1) == pytest.approx(steps.pace_at(100) or 0.0)
    assert steps.pace_at(1) == pytest.approx(1 / 0.0225)


def test_a_fixed_part_below_zero_is_taken_as_a_line_through_zero() -> None:
    steps = StepTimes()
    steps.observe(1 / 0.01, 10)
    steps.observe(1 / 0.05, 20)  # the free line would cross 0 at batch 7.5
    pace = steps.pace_at(1)
    assert pace is not None and math.isfinite(pace)
    per_sequence = (10 * 0.01 + 20 * 0.05) / (10**2 + 20**2)
    assert pace == pytest.approx(1 / per_sequence)


def test_a_band_moves_towards_new_readings() -> None:
    steps = steps_of(0.0, 0.001, 1, 40)
    before = steps.pace_at(40)
    for _ in range(20):
        steps.observe(1.0 / 0.08, 40)  # the engine got slower at 40: 2 ms a sequence
    after = steps.pace_at(40)
    assert before is not None and after is not None
    assert after < before and after == pytest.approx(1 / 0.08, rel=0.05)


@pytest.mark.parametrize(("pace", "batch"), [(0.0, 4), (-1.0, 4), (math.nan, 4), (10.0, 0), (math.inf, 2)])
def test_no_number_is_no_reading(pace: float, batch: float) -> None:
    steps = steps_of(0.0, 0.001, 1)
    steps.observe(pace, batch)
    assert steps.pace_at(8) is None
