"""The decode pace of one endpoint, per running sequence, from two scrapes of its metrics page: the
engines' measured pace (`EnginePaceMeter`), as against the pace the sidecar learns from the streams it
sees (`extproc.core.engine.pace.LearnedPace`).

An engine's generation-token counter (vLLM `vllm:generation_tokens_total`, SGLang
`sglang:realtime_tokens_total{mode="decode"}`: see `engines.py`) grows by every token it generates. Between
two scrapes (at least `min_window_s` apart), its growth over the interval over the mean number of running
requests at the interval's two ends is what each running sequence generated per second. The sidecar charges
a request whose end it never heard of with that pace when it has learned none from its own streams
(`extproc.core.engine.pace`), instead of a configured assumption that can be five times off.

No pace (None) rather than a wrong one on an endpoint's first scrape, after a counter that went down (the
engine restarted: the new value becomes the baseline) and after a value that is not a finite non-negative
number (the series starts afresh). A window with nothing running at one end or nothing generated (an idle,
starting, draining or stalled engine says nothing about its pace, and a pace of 0 would charge nothing), a
window whose two ends' running counts differ more than twofold (`MIN_RUNNING_RATIO`), a pace beyond any
engine's (`MAX_DECODE_TOKENS_PER_SECOND`) and a reading before the window is `min_window_s` long give no new
pace: the last one read is given again. Pure: the caller passes the monotonic time of each scrape.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Per sequence, far above any engine's decode pace (speculative decoding on a small model runs to a few
# thousand tokens a second per sequence): a pace beyond it comes from a counter that is not what it says.
MAX_DECODE_TOKENS_PER_SECOND = 100_000.0

MIN_RUNNING_RATIO = 0.5
"""A window is read only where the fewer running sequences at one end are at least this share of the more
at the other. Past it the batch grew or drained inside the window, and the mean of the two ends is no
measure of who generated its tokens: four streams of 20 tokens/s ending together, one running at the
window's end, read 31.4 tokens/s in an e2e run (tests/e2e/test_fed_pace_e2e.py), and that last window's
pace is the one held to charge them. Nothing running at one end is the extreme of the same case."""

PaceKey = tuple[str, str]  # (endpoint, model)


@dataclass(frozen=True, slots=True)
class _Reading:
    at: float
    generated: float
    running: float


@dataclass(frozen=True, slots=True)
class _Window:
    start: _Reading
    held: float | None = None  # the pace of the last window closed, given while the next one fills


def plausible_pace(value: float | None) -> float | None:
    """The pace if it can be one (finite, above 0, at most `MAX_DECODE_TOKENS_PER_SECOND`), else None.

    The feed's own bound, on what the meter reads and what the wire carries (`sample.checked`): this
    package imports nothing of the core, so it cannot share the sidecar's rule
    (`extproc.core.engine.pace.usable_rate`: finite and above 0), which reads every pace that arrives. This
    one adds the ceiling, as the wire must refuse a reading no engine can have whoever sends it."""
    if value is None or not math.isfinite(value) or not 0.0 < value <= MAX_DECODE_TOKENS_PER_SECOND:
        return None
    return value


def _usable(value: float | None) -> bool:
    return value is not None and math.isfinite(value) and value >= 0.0


class EnginePaceMeter:
    """An engine's measured decode rate per running sequence (its pace), per endpoint and model: the
    counter reading a window started at; `observe` gives the pace.

    A window closes at the first reading at least `min_window_s` after its start: a scrape's own latency
    varies by tens of milliseconds, which over a 200 ms interval is a 10 % error in the pace. While a window
    fills, and after a window that gives no reading, the last pace read is given again: every sample between
    carries it, and an engine that just drained still has the pace its last requests ran at (what charging
    them needs). A window whose ends' running counts differ more than twofold, nothing running at one end
    among them, is no reading: the batch started, grew or drained inside it, where the mean of the two ends
    is off by up to 2x either way.
    """

    def __init__(self, min_window_s: float = 1.0) -> None:
        self.min_window_s = min_window_s
        self._windows: dict[PaceKey, _Window] = {}

    def observe(
        self, key: PaceKey, generated: float | None, running: float | None, at: float
    ) -> float | None:
        """Tokens per second per running sequence over the last window of `key`, or None (see above)."""
        if generated is None or running is None or not (_usable(generated) and _usable(running)):
            self._windows.pop(key, None)  # a gap in the readings: the next window starts afresh
            return None
        now = _Reading(at, generated, running)
        window = self._windows.get(key)
        if window is None or generated < window.start.generated:
            self._windows[key] = _Window(now)  # first reading, or a counter reset: the new baseline
            return None
        start = window.start
        if at - start.at < self.min_window_s or at <= start.at:
            return window.held
        pace = None
        fewer, more = sorted((start.running, running))
        if more > 0.0 and fewer / more >= MIN_RUNNING_RATIO:
            pace = plausible_pace(
                (generated - start.generated) / (at - start.at) / ((start.running + running) / 2)
            )
        held = pace if pace is not None else window.held
        self._windows[key] = _Window(now, held)
        return held

    def forget(self, endpoint: str) -> None:
        """Drop an endpoint's windows (its scrape failed or it left): its counter may restart meanwhile."""
        for key in [k for k in self._windows if k[0] == endpoint]:
            del self._windows[key]

    def __len__(self) -> int:
        return len(self._windows)
