"""The queue's drain pace (extproc/core/queue/drain.py): grants over backlogged time only, and a refusal only
where the line ahead could not drain within the wait even at twice that pace."""

from __future__ import annotations

import pytest

from extproc.core.queue.drain import HORIZON_S, MIN_GRANTS, OPTIMISM, DrainPace


def drained(grants: int, every_s: float, start: float = 0.0) -> DrainPace:
    """A pace that saw `grants` grants `every_s` apart while someone waited throughout."""
    pace = DrainPace()
    pace.depth(start, 5)
    for i in range(1, grants + 1):
        pace.granted(start + i * every_s)
    return pace


def test_no_pace_and_no_refusal_before_enough_grants() -> None:
    pace = drained(MIN_GRANTS - 1, 1.0)
    assert pace.rate(MIN_GRANTS - 1.0) is None
    # A cold queue: everyone waits.
    assert pace.out_of_reach(MIN_GRANTS - 1.0, ahead=1_000, wait_s=1.0) is None


def test_the_pace_is_grants_per_backlogged_second() -> None:
    pace = drained(10, 0.5)
    assert pace.rate(5.0) == pytest.approx(9 / 4.5)


def test_time_with_nobody_waiting_does_not_slow_the_pace() -> None:
    pace = drained(10, 0.5)
    pace.depth(5.0, 0)  # the queue empties for a minute
    pace.depth(65.0, 3)
    assert pace.rate(65.0) == pytest.approx(9 / 4.5)


def test_a_stalled_queue_reads_slower_at_once() -> None:
    pace = drained(10, 0.5)
    assert pace.rate(14.5) == pytest.approx(9 / 14.0)  # still waiting, no grant for 9.5 s


def test_grants_past_the_horizon_are_forgotten() -> None:
    pace = drained(10, 0.5)
    pace.depth(5.0, 0)
    assert pace.rate(5.0 + HORIZON_S) is None


def test_refused_only_past_twice_the_measured_pace() -> None:
    pace = drained(11, 1.0)  # one grant a second
    now = 11.0
    within = int(OPTIMISM * 1.0 * 10)  # 20 ahead drain in 10 s at twice the pace
    assert pace.out_of_reach(now, ahead=within, wait_s=10.0) is None
    # 21 ahead: refused, told 21 s (the pace measured).
    assert pace.out_of_reach(now, ahead=within + 1, wait_s=10.0) == pytest.approx(within + 1)
    assert pace.out_of_reach(now, ahead=0, wait_s=0.0) is None  # nobody ahead: it is next
