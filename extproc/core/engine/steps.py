"""An engine's decode step time against its batch, fitted from the paces the feed reads: the pace per
sequence a batch of another size will run at, for retry hints.

Each running sequence gets one token per decode step, so a pace per sequence is the inverse of a step's
time, and a step's time grows with its batch from a fixed part: `step = fixed + per_sequence x batch`. On a
GPU the fixed part (reading the weights) dominates at small batches, so the pace per sequence barely moves
with the batch; on a CPU the per-sequence part does, and the pace falls in proportion. Which one an engine
is, only its readings say, so both parts are fitted from them.

The feed gives a pace read over a window with the engines' running sequences (`EnginePaceMeter`); the last
pace read is held while the engine drains or idles. A retry hint taken at that held pace is off by the
ratio of their step times: after forty-eight chats on the real-engine tier's vLLM (16.8 tokens/s per
sequence), the next burst's refused clients were told the end of its first wave of thirty-two at that pace,
17.9 s, where it ended at 10.3-10.9 s (about 30 tokens/s); fitted, the hints took 28.3 and were 10.7 s, and
the burst's slowest first token came at 10.9-11.5 s in three runs against 11.3-23.2 s held.

Readings are kept per batch band (powers of two), each an exponentially weighted mean of its step times, so
a band last read an hour ago still says what a step of that size costs while the engine runs another. The
fit is a least squares line over the bands' means, each band one point, its two parts held non-negative.
No pace (None) with fewer than two bands read: one batch size says nothing of another. Pure.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

ALPHA = 0.3
"""Weight of a new reading in its band's mean: an engine's step cost moves little at a given batch, but a
reading's window spans batches that change inside it (`MIN_RUNNING_RATIO` lets them differ twofold)."""

MAX_BANDS = 16
"""Bands 1, 2-3, 4-7, ... up to 32,768 running sequences and beyond in the last."""


def _band(batch: float) -> int:
    return min(MAX_BANDS - 1, int(math.log2(max(1.0, batch))))


@dataclass
class _Band:
    batch: float
    step_s: float


@dataclass
class StepTimes:
    """Step time per batch band and the line fitted through them (see the module docstring)."""

    _bands: dict[int, _Band] = field(default_factory=dict)
    _line: tuple[float, float] | None = None  # (fixed seconds, seconds per sequence)

    def observe(self, pace: float, batch: float) -> None:
        """A pace per sequence (tokens per second) the engines were read at while running `batch`
        sequences; nothing where either is no number above 0."""
        if not (math.isfinite(pace) and pace > 0.0 and math.isfinite(batch) and batch > 0.0):
            return
        key, step = _band(batch), 1.0 / pace
        old = self._bands.get(key)
        if old is None:
            self._bands[key] = _Band(batch, step)
        else:
            old.batch += ALPHA * (batch - old.batch)
            old.step_s += ALPHA * (step - old.step_s)
        self._line = _fit(list(self._bands.values()))

    def pace_at(self, batch: float) -> float | None:
        """The pace per sequence a batch of `batch` sequences (at least one) is expected to run at; None
        until two bands have been read."""
        if self._line is None:
            return None
        fixed, per_sequence = self._line
        step = fixed + per_sequence * max(1.0, batch)
        return 1.0 / step if step > 0.0 else None


def _fit(bands: list[_Band]) -> tuple[float, float] | None:
    """The line `step = fixed + per_sequence x batch` through the bands' means by least squares, both parts
    non-negative: where the free fit makes one negative, the best line with that part 0."""
    if len(bands) < 2:
        return None
    n = float(len(bands))
    mean_b = sum(b.batch for b in bands) / n
    mean_s = sum(b.step_s for b in bands) / n
    spread = sum((b.batch - mean_b) ** 2 for b in bands)
    slope = sum((b.batch - mean_b) * (b.step_s - mean_s) for b in bands) / spread
    fixed = mean_s - slope * mean_b
    if slope < 0.0:  # steps no slower with the batch: a constant step
        return mean_s, 0.0
    if fixed < 0.0:  # steps in proportion to the batch: the line through 0
        return 0.0, sum(b.batch * b.step_s for b in bands) / sum(b.batch**2 for b in bands)
    return fixed, slope
