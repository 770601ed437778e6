"""How late capacity comes against the forecast that promised it: a margin learned from what was seen.

The deadlines' layout (extproc/admission/capacity/queueing.py) says when each waiter should have its
capacity, from the open leases' remaining times (`slot_eta.py`) and the runs of the waiters ahead. Those
run a little past their forecast (the end report's flush, the first token's delay, the engine's steps on a
loaded host), and the further off a start is, the more runs it waits behind and the more it slips: on the
local stack the 95th percentile was ~50 ms for starts under a second away, ~140 ms for starts 2-4 s away.
A wait promised to end just before its deadline then ends just after it.

So each grant is compared with when it was first expected, the slip (how much later it came; early counts
as none) taken per second of that horizon, and a high quantile of the recent ones, times a newcomer's own
horizon, is the margin its wait must keep from its deadline to be promised at all. Horizons under
`floor_s` count as `floor_s`: the slip of a start due almost at once is mostly not proportional to anything.
Until `min_samples` grants were seen, `prior` stands (a cold engine, a rate still assumed: trusted least).

The margin is asked of newcomers only; a waiter once promised is never refused on it. Pure and
synchronous: callers pass the times.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field


@dataclass
class ForecastSlip:
    """The recent slips of granted capacity past its forecast, per second of horizon, and a margin."""

    window: int = 128
    quantile: float = 0.95
    min_samples: int = 8
    prior: float = 1.0
    floor_s: float = 0.5
    _rates: deque[float] = field(default_factory=deque, init=False)
    _rate: float | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if not 0.0 < self.quantile <= 1.0:
            raise ValueError(f"quantile must be in (0, 1], got {self.quantile}")
        if self.window < 1 or self.min_samples < 1 or self.floor_s <= 0 or self.prior < 0:
            raise ValueError("window and min_samples must be >= 1, floor_s > 0, prior >= 0")

    def observe(self, noted: float, forecast: float, granted: float) -> None:
        """Capacity expected (as of `noted`) at `forecast` came at `granted`, all on one clock."""
        horizon = max(self.floor_s, forecast - noted)
        self._rates.append(max(0.0, granted - forecast) / horizon)
        if len(self._rates) > self.window:
            self._rates.popleft()
        self._rate = None

    def rate(self) -> float:
        """Slip per second of horizon a promise allows for: `prior` until `min_samples` were seen."""
        if len(self._rates) < self.min_samples:
            return self.prior
        if self._rate is None:
            ordered = sorted(self._rates)
            rank = min(len(ordered) - 1, max(0, math.ceil(self.quantile * len(ordered)) - 1))
            self._rate = ordered[rank]
        return self._rate

    def margin(self, horizon: float) -> float:
        """Seconds a start expected `horizon` seconds from now should keep clear of its deadline."""
        return self.rate() * max(self.floor_s, horizon)
