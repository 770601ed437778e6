"""The layout deadlines are weighed against (`SlotHints.starts`): when each request of a line gets a slot."""

from __future__ import annotations

import pytest

from extproc.admission.capacity.hints import SlotHints
from extproc.core.limiter.limiter import RateLimitStatus, Reason, Rejection
from extproc.core.queue.slot_eta import OpenLease

STATUS = RateLimitStatus(2, 0, None, None, None, 1.0)


def refused(reason: Reason, retry_after_s: float | None = 1.0) -> Rejection:
    return Rejection(reason=reason, key="global", retry_after_s=retry_after_s, status=STATUS)


def leases(*seconds: float) -> list[OpenLease]:
    return [OpenLease(expected_tokens=s * 100, streamed_tokens=0, rate=100) for s in seconds]


def test_each_freed_slot_is_taken_again_by_the_next_in_line_for_its_run() -> None:
    starts = SlotHints().starts(refused(Reason.CONCURRENCY), lambda _key: leases(1.0, 3.0), [2.0, 0.5, 1.0])
    assert starts == pytest.approx([1.0, 3.0, 3.0])  # 1 s; 3 s (the first slot is busy until 3); 3 s


def test_slots_held_by_leases_not_open_yet_count() -> None:
    hints = SlotHints()
    assert hints.starts(refused(Reason.CONCURRENCY), lambda _key: leases(1.0), [0.5, 0.5], held=[2.0]) == (
        pytest.approx([1.0, 1.5])
    )
    assert SlotHints().starts(refused(Reason.CONCURRENCY), lambda _key: [], [0.5], held=[2.0]) == [2.0]


def test_the_open_leases_are_read_afresh_each_time() -> None:
    """A lease the queue granted moves from `held` to the open leases between two layouts: a cached read
    of the open leases (as the retry hints keep for 50 ms) would lose its slot."""
    hints = SlotHints()
    assert hints.starts(refused(Reason.CONCURRENCY), lambda _key: leases(1.0), [0.5], held=[2.0]) == [1.0]
    assert hints.starts(refused(Reason.CONCURRENCY), lambda _key: leases(1.0, 2.0), [3.0, 0.5]) == [1.0, 2.0]


def test_tokens_wait_for_the_refill_and_nothing_tells_without_leases_here() -> None:
    hints = SlotHints()
    assert hints.starts(refused(Reason.TOKENS, 4.0), lambda _key: [], [1.0, 1.0]) == [4.0, 4.0]
    assert hints.starts(refused(Reason.TOKENS, None), lambda _key: [], [1.0]) is None
    assert SlotHints().starts(refused(Reason.CONCURRENCY), lambda _key: [], [1.0]) is None
