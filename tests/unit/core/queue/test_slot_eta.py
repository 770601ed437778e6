"""Slot retry hints from the leases actually open: right when they free together, and no herd."""

from __future__ import annotations

import pytest

from extproc.core.queue.slot_eta import MAX_HINT_S, MIN_REMAINING_S, OpenLease, RetryHints, remaining_times


def test_eight_answers_started_together_free_together_four_seconds_later() -> None:
    leases = [OpenLease(expected_tokens=400, streamed_tokens=0, rate=100) for _ in range(8)]
    hints = RetryHints(rand=lambda: 0.0)
    assert hints.hint("model:m", remaining_times(leases), now=0.0) == pytest.approx(4.0)


def test_progress_shortens_the_remaining_time_and_an_overrun_is_never_zero() -> None:
    assert OpenLease(400, 300, 100).remaining_s() == pytest.approx(1.0)
    assert OpenLease(400, 500, 100).remaining_s() == pytest.approx(16 / 100)
    assert OpenLease(1, 0, 1e9).remaining_s() == MIN_REMAINING_S
    # Ended at the proxy, its end report on the way: the slot frees as soon as the sidecar hears of it.
    assert OpenLease(400, 0, 100, ended=True).remaining_s() == MIN_REMAINING_S


def test_successive_refusals_aim_at_successive_slots_then_the_history_expires() -> None:
    hints = RetryHints(rand=lambda: 0.0)
    etas = [1.0, 2.0, 3.0]
    got = [hints.hint("k", etas, now=0.0) for _ in range(4)]
    assert got == [1.0, 2.0, 3.0, 3.0]
    assert hints.hint("k", etas, now=10.0) == 1.0  # earlier hints are long used: start over
    assert hints.hint("other", etas, now=10.0) == 1.0  # per key


def test_jitter_only_delays_and_hints_are_capped_at_what_sdks_honour() -> None:
    hints = RetryHints(jitter=0.15, rand=lambda: 1.0)
    assert hints.hint("k", [2.0], now=0.0) == pytest.approx(2.3)
    assert hints.hint("j", [500.0], now=0.0) == MAX_HINT_S
    assert hints.hint("k", [], now=0.0) is None
