"""Readings of one pool over time, bounded in memory: the engines' counters a charge tally keeps
(`tally.TallyPoint`) and the other replicas' runs it reads from the store (`tally.PeerRuns`) follow one rule,
so one type keeps both.

At most `max_points` readings, one per `min_spacing_s` (a newer one replaces a last one that came sooner
after its predecessor, so a burst of readings costs one slot); past `max_points` the oldest quarter goes at
once (trimming one at a time would move the whole list at every reading). Time never goes back: readings
arrive in order, but a scrape's or a store call's timing varies, so one timed before the last is taken at
the last's time. The times are a list of their own, for `bisect`.
"""

from __future__ import annotations

import bisect
from typing import Generic, TypeVar

T = TypeVar("T")


class Series(Generic[T]):
    """Readings (`items`) at `times`, oldest first (see the module docstring)."""

    def __init__(self, max_points: int, min_spacing_s: float) -> None:
        self.max_points = max_points
        self.min_spacing_s = min_spacing_s
        self.times: list[float] = []
        self.items: list[T] = []

    def kept_at(self, at: float) -> float:
        """The time a reading at `at` would be kept at: never before the last one's."""
        return max(at, self.times[-1]) if self.times else at

    def add(self, at: float, item: T) -> float:
        """A reading at `at`; the time it is kept at (`kept_at`)."""
        times, items = self.times, self.items
        at = self.kept_at(at)
        if len(times) > 1 and times[-1] - times[-2] < self.min_spacing_s:
            items[-1], times[-1] = item, at  # the last one came too soon after its predecessor
        else:
            items.append(item)
            times.append(at)
        if len(times) > self.max_points:
            drop = len(times) - self.max_points * 3 // 4
            del items[:drop], times[:drop]
        return at

    def at_or_before(self, at: float) -> int:
        """The index of the last reading at or before `at`; -1 where none is."""
        return bisect.bisect_right(self.times, at) - 1

    def at_or_after(self, at: float) -> int:
        """The index of the first reading at or after `at`; `len(self)` where none is."""
        return bisect.bisect_left(self.times, at)

    def last_at(self) -> float | None:
        """The time of the newest reading; None before the first."""
        return self.times[-1] if self.times else None

    def __len__(self) -> int:
        return len(self.times)
