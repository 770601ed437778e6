"""`Series`: one bounded, spaced list of readings for the charge tally's counters and the other replicas'
runs."""

from __future__ import annotations

from extproc.core.engine.series import Series


def test_a_reading_that_came_too_soon_after_its_predecessor_is_replaced_by_the_next() -> None:
    series: Series[str] = Series(max_points=100, min_spacing_s=0.1)
    for at, item in ((0.0, "a"), (1.0, "b"), (1.05, "c"), (1.08, "d"), (2.0, "e")):
        series.add(at, item)
    # "c" came 0.05 s after "b": kept until the next, which takes its place ("d"), and so on ("e").
    assert series.times == [0.0, 1.0, 2.0] and series.items == ["a", "b", "e"]


def test_time_never_goes_back_and_lookups_bisect() -> None:
    series: Series[int] = Series(max_points=100, min_spacing_s=0.1)
    assert series.last_at() is None and series.at_or_before(5.0) == -1
    series.add(1.0, 1)
    assert series.add(0.5, 2) == 1.0  # timed before the last: taken at the last's time
    series.add(2.0, 3)  # the one at 1.0 again came too soon: replaced
    assert series.times == [1.0, 2.0] and series.items == [1, 3]
    assert series.at_or_before(0.9) == -1 and series.at_or_before(1.5) == 0 and series.at_or_after(1.5) == 1
    assert series.at_or_after(2.5) == len(series) == 2 and series.last_at() == 2.0


def test_past_its_bound_the_oldest_quarter_goes() -> None:
    series: Series[int] = Series(max_points=100, min_spacing_s=0.1)
    for i in range(1000):
        series.add(i * 0.05, i)  # twice as often as the spacing: every other one replaced
    assert len(series) <= 100
    assert series.items[-1] == 999 and series.times[0] > 0.0
    gaps = [b - a for a, b in zip(series.times, series.times[1:], strict=False)]
    assert min(gaps[:-1]) >= 0.1 - 1e-9  # the last one may have come sooner: the next replaces it
