"""Time as an injected dependency.

The limiter's arithmetic depends on elapsed time (refill, hold-time estimates), so the core never reads the
system clock itself: callers pass a `Clock`. Production code uses `time.monotonic`; tests use `FakeClock`
and move time explicitly, which makes every limiter test deterministic and free of sleeps.
"""

from __future__ import annotations

import time
from collections.abc import Callable

Clock = Callable[[], float]
"""A source of monotonic seconds. Only differences between readings are meaningful."""

monotonic: Clock = time.monotonic


class FakeClock:
    """A clock that only moves when told to."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError("a monotonic clock cannot go back")
        self.now += seconds
