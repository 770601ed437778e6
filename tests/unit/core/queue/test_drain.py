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
    assert pace.out_of_reach(MIN_GRANTS - 1.0, ahead=[100.0] * 1_000, end=MIN_GRANTS) is None


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


def test_refused_only_where_its_turn_comes_after_its_wait_even_at_twice_the_pace() -> None:
    """Everyone waiting up to 30 s: at one grant a second (two, at twice the pace) 19 ahead leave a newcomer
    whose wait ends in 10 s its turn in 10 s; 20 ahead, in 10.5 s: refused, told 21 s (the measured pace,
    behind the 20 that are served by then)."""
    pace = drained(11, 1.0)  # one grant a second
    now = 11.0
    within = int(OPTIMISM * 1.0 * 10) - 1
    assert pace.out_of_reach(now, ahead=[now + 30] * within, end=now + 10) is None
    assert pace.out_of_reach(now, ahead=[now + 30] * (within + 1), end=now + 10) == pytest.approx(21.0)
    assert pace.out_of_reach(now, ahead=[], end=now) is None  # nobody ahead: it is next


def test_waiters_that_time_out_first_do_not_hold_a_newcomer_back() -> None:
    """A line of 23 whose waits end within the second, at a pace of one grant a second: one is served, the
    rest time out, and the newcomer's turn comes in about a second, long before its own wait ends: it waits.
    Counted as 23 ahead it was refused, told 23 s (found in review)."""
    pace = drained(11, 1.0)
    now = 11.0
    assert pace.out_of_reach(now, ahead=[now + 1.0] * 23, end=now + 25) is None
