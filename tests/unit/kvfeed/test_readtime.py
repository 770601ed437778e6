"""When a sample's counters were read (`ReadTimes`): what a charge tally's points are stamped at."""

from __future__ import annotations

from extproc.kvfeed.subscriber.readtime import MAX_DELAY_S, WINDOW, ReadTimes


def test_a_sample_delivered_late_is_stamped_when_it_was_read_whatever_the_clocks_skew() -> None:
    """The exporter's clock runs 40 s ahead of the sidecar's wall clock, and the sidecar's monotonic clock
    reads 1,000 s less: a sample on time is stamped at its arrival, one that came 3 s after its reading at
    its reading."""
    times = ReadTimes()
    skew, mono = 40.0, -1_000.0
    assert times.read_at("a", 100.0 + skew, 100.0 + mono, 100.0) == 100.0 + mono
    assert times.read_at("a", 102.0 + skew, 105.0 + mono, 105.0) == 102.0 + mono
    assert times.read_at("a", 104.0 + skew, 105.1 + mono, 105.1) == 104.0 + mono
    # Another endpoint has its own exporter, and its own skew.
    assert times.read_at("b", 90.0, 105.2 + mono, 105.2) == 105.2 + mono


def test_the_timely_offset_is_relearned_within_the_window_after_a_clock_step() -> None:
    """The exporter's clock is stepped 10 s back: each sample then looks 10 s late until the window's
    timely offset from before the step has gone; then samples on time are stamped on arrival again. A delay
    is never taken past `MAX_DELAY_S`."""
    times = ReadTimes()
    assert times.read_at("a", 0.0, 0.0, 0.0) == 0.0
    stepped = [times.read_at("a", float(i) - 10.0, float(i), float(i)) for i in range(1, WINDOW + 2)]
    assert stepped[0] == -9.0
    assert stepped[WINDOW - 2] == WINDOW - 11.0  # the pre-step sample still in the window
    assert stepped[WINDOW - 1] == WINDOW  # gone: relearned
    assert stepped[WINDOW] == WINDOW + 1.0
    assert times.read_at("a", WINDOW - 100.0, WINDOW + 2.0, WINDOW + 2.0) == WINDOW + 2.0 - MAX_DELAY_S


def test_forgotten_endpoints_start_afresh() -> None:
    times = ReadTimes()
    times.read_at("a", 0.0, 0.0, 0.0)
    times.read_at("b", 0.0, 0.0, 0.0)
    times.keep({"b"})
    assert times.read_at("a", 5.0, 10.0, 10.0) == 10.0  # its first sample again: on time
    assert times.read_at("b", 5.0, 10.0, 10.0) == 5.0
