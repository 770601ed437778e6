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
footprint for its whole life. Where a request's expected length is only a guess below the bound the server
enforces, its forecast must not end there: its trajectory grows to the expected size, then holds it until
the bound's end (`Lease.pieces`), so the real peak exceeds the forecast one by no more than the tokens the
guesses left out (`kv_credit` bounds those per tenant).

Pure and synchronous: no clock, no I/O; callers pass times in seconds from their own clock.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable, Sequence
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


def forecast_peaks(trajectories: Iterable[Steps], extra: Sequence[Steps] = ()) -> tuple[float, float]:
    """The forecast peak of `trajectories`, and of `trajectories` plus the pieces of `extra` (one request's
    trajectory, in one or more pieces: `Lease.pieces`), in one sort and one sweep.

    Between two ends the total only rises, so the peak is at an end `e`: the sum over trajectories still
    present at `e` (those with `end >= e`) of `base + slope * e`. An infinite end contributes its base only
    (a flat booking; an unbounded rise has no peak to report). A piece may have a negative base (a request
    that grows, then holds its size, is a flat piece plus a rising one worth nothing at its end): the total
    still only rises between ends and never rises at one, so the peak is still at an end. The sweep visits
    ends from the latest down, accumulating the trajectories present, and evaluates both totals at every end
    of either (an end of the extra's alone is harmless: a total there is never above its next end). This
    runs on every admission decision, hence the plain loop over plain tuples.
    """
    extras = sorted(((b, s if e != _INF else 0.0, e if e > 0 else 0.0) for b, s, e in extra), key=_END)
    peak = together = bases = slopes = x_bases = x_slopes = 0.0
    group = -1.0  # the end whose trajectories are being added; -1 before the first

    def evaluate(e: float) -> None:
        """Both totals at step `e`, of what was accumulated so far."""
        nonlocal peak, together
        if e == _INF:
            value, with_extra = bases, bases + x_bases
        else:
            value = bases + slopes * e
            with_extra = value + x_bases + x_slopes * e
        peak, together = max(peak, value), max(together, with_extra)

    def take_extra() -> None:
        """The extra's piece that ends latest of those left, added (its end evaluated first if new)."""
        nonlocal group, x_bases, x_slopes
        x_base, x_slope, x_end = extras.pop()
        if x_end != group:
            if group >= 0:
                evaluate(group)
            group = x_end
        x_bases += x_base
        x_slopes += x_slope

    for base, slope, end in sorted(trajectories, key=_END, reverse=True):
        end = end if end > 0 else 0.0
        while extras and extras[-1][2] > end:  # the extra's pieces that end later come first
            take_extra()
        if end != group:
            if group >= 0:
                evaluate(group)
            group = end
        bases += base
        if end != _INF:
            slopes += slope
    while extras:
        take_extra()
    if group >= 0:
        evaluate(group)
    return peak, (together if extra else peak)


_INF = math.inf
_END = operator.itemgetter(2)
