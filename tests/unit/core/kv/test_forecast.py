"""Forecast peak of request trajectories."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from extproc.core.kv.forecast import Trajectory, forecast_peak, forecast_peaks


def test_peak_of_nothing_is_zero() -> None:
    assert forecast_peak([]) == 0.0


def test_one_request_peaks_at_its_last_token() -> None:
    assert forecast_peak([Trajectory(1_000, 1, 200)]) == 1_200


def test_an_early_end_frees_before_the_others_peak() -> None:
    # A: 1,000 now, growing to 1,050 at step 50, then gone. B: 100 now, growing to 400 at step 300.
    a, b = Trajectory(1_000, 1, 50), Trajectory(100, 1, 300)
    # At step 50 both are present: 1,050 + 150; at step 300 only B: 400.
    assert forecast_peak([a, b]) == 1_200
    # Booking both at their final size for their whole lives would say 1,450.


def test_flat_bookings_and_requests_past_their_end() -> None:
    flat = Trajectory(500, 0, math.inf)
    assert forecast_peak([flat]) == 500
    assert forecast_peak([flat, Trajectory(100, 1, 10)]) == 610
    # A negative end (past its expected last token, not yet released) still counts now.
    assert forecast_peak([Trajectory(300, 1, -5)]) == 300
    assert forecast_peak([Trajectory(300, 1, -5), Trajectory(10, 1, 2)]) == 310  # both now; 12 at step 2


def test_requests_ending_at_the_same_step_are_all_present_at_it() -> None:
    assert forecast_peak([Trajectory(10, 1, 5), Trajectory(20, 2, 5)]) == 10 + 5 + 20 + 10


trajectories = st.lists(
    st.builds(
        Trajectory,
        st.integers(0, 5_000).map(float),
        st.integers(0, 4).map(float),
        st.integers(-3, 400).map(float),
    ),
    max_size=30,
)


@given(trajectories)
def test_peak_equals_the_maximum_over_every_step(items: list[Trajectory]) -> None:
    """The sweep over ends agrees with evaluating every integer step (all ends are integers here)."""
    horizon = max((int(t.end) for t in items), default=0)
    horizon = max(0, horizon)

    def total(k: int) -> float:
        return sum(t.base + t.slope * k for t in items if max(0.0, t.end) >= k)

    brute = max((total(k) for k in range(0, horizon + 1)), default=0.0)
    assert forecast_peak(items) == pytest.approx(brute)


@given(
    trajectories,
    st.builds(
        Trajectory,
        st.integers(0, 5_000).map(float),
        st.integers(0, 4).map(float),
        st.integers(-3, 400).map(float),
    ),
)
def test_peaks_with_an_extra_request_in_one_sweep(items: list[Trajectory], extra: Trajectory) -> None:
    alone, together = forecast_peaks(items, (extra,))
    assert alone == pytest.approx(forecast_peak(items))
    assert together == pytest.approx(forecast_peak([*items, extra]))
    assert forecast_peaks(items) == (alone, alone)


def test_peaks_with_flat_and_unbounded_bookings() -> None:
    flat = Trajectory(500, 0, math.inf)
    assert forecast_peaks([flat], (Trajectory(100, 1, 10),)) == (500, 610)
    assert forecast_peaks([Trajectory(100, 1, 10)], (flat,)) == (110, 610)
    assert forecast_peaks([], (flat,)) == (0, 500)


def held(base: int, grows: int, holds: int) -> list[Trajectory]:
    """A request of `base` tokens that grows `grows` tokens, one a step, then holds its size until step
    `holds`: a flat piece plus a rising one worth nothing at its end (`Lease.pieces`)."""
    size = float(base + grows)
    return [Trajectory(size, 0, holds), Trajectory(-float(grows), 1, grows)]


def test_a_held_request_keeps_its_size_past_its_growth() -> None:
    # 100 + 50 grown by step 50, held to step 300; another request 100 growing to 400 at step 300.
    other = Trajectory(100, 1, 300)
    assert forecast_peak(held(100, 50, 300)) == 150
    assert forecast_peak([*held(100, 50, 300), other]) == 150 + 400  # both present at step 300
    assert forecast_peak([Trajectory(100, 1, 50), other]) == 400  # without the hold: gone by then
    assert forecast_peaks([other], held(100, 50, 300)) == (400, 550)
    assert forecast_peaks(held(100, 50, 300), (other,)) == (150, 550)


@given(
    trajectories,
    st.lists(
        st.tuples(st.integers(0, 5_000), st.integers(0, 400), st.integers(0, 400)), min_size=1, max_size=3
    ),
)
def test_peaks_with_held_pieces_equal_the_maximum_over_every_step(
    items: list[Trajectory], holds: list[tuple[int, int, int]]
) -> None:
    """Pieces with negative bases, in the set and as the extra, agree with evaluating every step."""
    pieces = [piece for base, grows, extra in holds for piece in held(base, grows, grows + extra)]
    everything = [*items, *pieces]
    horizon = max(0, max(int(t.end) for t in everything))

    def total(k: int) -> float:
        return sum(t.base + t.slope * k for t in everything if max(0.0, t.end) >= k)

    brute = max(total(k) for k in range(0, horizon + 1))
    assert forecast_peak(everything) == pytest.approx(brute)
    assert forecast_peaks(items, pieces)[1] == pytest.approx(brute)
