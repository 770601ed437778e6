"""A rate limiter for repetitive failure logs (JSON logging itself lives in `extproc.logs`).

A target that is down fails every second; logging each failure would flood the node's log pipeline, so
state changes (up -> down, down -> up, new reason) are always logged and repeats at most once per window.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable


class RateLimitedLog:
    """Allows one log per key per `interval` seconds; `allow` also reports how many were suppressed."""

    def __init__(self, interval: float = 30.0, clock: Callable[[], float] = time.monotonic) -> None:
        self._interval = interval
        self._clock = clock
        self._last: dict[Hashable, float] = {}
        self._suppressed: dict[Hashable, int] = {}

    def allow(self, key: Hashable) -> tuple[bool, int]:
        now = self._clock()
        last = self._last.get(key)
        if last is not None and now - last < self._interval:
            self._suppressed[key] = self._suppressed.get(key, 0) + 1
            return False, 0
        self._last[key] = now
        return True, self._suppressed.pop(key, 0)

    def forget(self, key: Hashable) -> None:
        self._last.pop(key, None)
        self._suppressed.pop(key, None)
