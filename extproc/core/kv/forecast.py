"""The KV a set of running requests will hold from now on, and the highest it will get.

A decoding engine (vLLM, SGLang, TGI, TensorRT-LLM) runs every admitted sequence in one batch: each engine
step appends one token, and one token's KV, to every running sequence, and a finished sequence frees all
of its blocks at once. So, counted in engine steps `k` from now, a request holds

    base + slope x k   while 0 <= k <= end,   and nothing after `end`,

where `base` = its prompt plus the tokens generated so far, `slope` = the sequences it decodes in parallel,
and `end` = the steps until its expected last token. The sum of these trajectories only rises between two
ends and only falls at an end, so its maximum over the future is reached at one of the ends: the forecast
peak is a maximum over `n` suffix sums after sorting by end, O(n log n). Steps are the common unit, so no
decode rate is needed for the peak itself; the rate only enters when a caller estimates how far a request
it cannot observe has come (`extproc.core.engine.pace.LearnedPace`).

If every `end` is at least the request's real remaining length, the forecast peak bounds the real peak of
those requests (each real trajectory lies under its forecast one), which is what lets an admission that
keeps the forecast peak under a budget avoid preemption without booking every request's whole final
footprint for its whole life.

Pure and synchronous: no clock, no I/O; callers pass times in seconds from their own clock.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable
from typing import NamedTuple


class Trajectory(NamedTuple):
    """KV tokens one request holds `k` engine steps from now: `base + slope * k` until `end`, then none.

    A flat trajectory (`slope` 0) books a fixed amount; `end` = inf books it until further notice. A
    negative `end` (a request past its expected last token, not yet released) counts now only.
    """

    base: float
    slope: float
    end: float


Steps = tuple[float, float, float]
"""A trajectory as a plain tuple (base, slope, end): `Trajectory` is one, and so is what the budget builds."""


def forecast_peak(trajectories: Iterable[Steps]) -> float:
    """Highest total KV the trajectories reach at any step from now on (0 for none)."""
    return forecast_peaks(trajectories)[0]


def forecast_peaks(trajectories: Iterable[Steps], extra: Steps | None = None) -> tuple[float, float]:
    """The forecast peak of `trajectories`, and of `trajectories` plus `extra`, in one sort and one sweep.

    Between two ends the total only rises, so the peak is at an end `e`: the sum over trajectories still
    present at `e` (those with `end >= e`) of `base + slope * e`. An infinite end contributes its base only
    (a flat booking; an unbounded rise has no peak to report). The sweep visits ends from the latest down,
    accumulating the trajectories present, and evaluates both totals at every end and at the extra's own
    end (a point that is not an end is harmless: a total there is never above its next end). This runs on
    every admission decision, hence the plain loop over plain tuples.
    """
    x_base, x_slope, x_end = extra if extra is not None else (0.0, 0.0, -1.0)
    x_end = max(x_end, 0.0) if extra is not None else -1.0
    x_slope = 0.0 if x_end == _INF else x_slope
    pending = extra is not None  # the extra's own end is still to be evaluated
    peak = together = bases = slopes = 0.0
    group = -1.0  # the end whose trajectories are being added; -1 before the first

    def totals(e: float) -> tuple[float, float]:
        """Total KV at step `e` of what was accumulated so far, without and with the extra."""
        if e == _INF:
            return bases, bases + (x_base if x_end == _INF else 0.0)
        value = bases + slopes * e
        return value, value + (x_base + x_slope * e if x_end >= e else 0.0)

    for base, slope, end in sorted(trajectories, key=_END, reverse=True):
        end = end if end > 0 else 0.0
        if end != group:
            points: tuple[float, ...] = (group,) if group >= 0 else ()
            if pending and end < x_end:  # the extra ends between the previous end and this one
                points += (x_end,)
                pending = False
            for e in points:
                value, with_extra = totals(e)
                peak, together = max(peak, value), max(together, with_extra)
            pending = pending and x_end != group
            group = end
        bases += base
        if end != _INF:
            slopes += slope
    for e in ((group,) if group >= 0 else ()) + ((x_end,) if pending else ()):
        value, with_extra = totals(e)
        peak, together = max(peak, value), max(together, with_extra)
    return peak, (together if extra is not None else peak)


_INF = math.inf
_END = operator.itemgetter(2)
