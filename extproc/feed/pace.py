"""The decode pace of one endpoint, per running sequence, from two scrapes of its metrics page.

An engine's generation-token counter (vLLM `vllm:generation_tokens_total`, SGLang
`sglang:realtime_tokens_total{mode="decode"}`: see `engines.py`) grows by every token it generates. Between
two scrapes, its growth over the interval over the mean number of running requests at the interval's two
ends is what each running sequence generated per second. The sidecar charges a request whose end it never
heard of with that pace when it has learned none from its own streams (`extproc.core.decode_rate`), instead
of a configured assumption that can be five times off.

No reading (None) rather than a wrong one: on an endpoint's first scrape, when the counter went down (the
engine restarted: the new value becomes the baseline), when nothing ran at either end or nothing was generated
(an idle or stalled engine says nothing about its pace, and a pace of 0 would charge nothing), when a value is
not a finite non-negative number, when the clock did not move, or when the pace is beyond any engine's
(`MAX_DECODE_TOKENS_PER_SECOND`). Pure: the caller passes the monotonic time of each scrape.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Per sequence, far above any engine's decode pace (speculative decoding on a small model runs to a few
# thousand tokens a second per sequence): a pace beyond it comes from a counter that is not what it says.
MAX_DECODE_TOKENS_PER_SECOND = 100_000.0

PaceKey = tuple[str, str]  # (endpoint, model)


@dataclass(frozen=True, slots=True)
class _Reading:
    at: float
    generated: float
    running: float


def plausible_pace(value: float | None) -> float | None:
    """The pace if it can be one (finite, above 0, at most `MAX_DECODE_TOKENS_PER_SECOND`), else None."""
    if value is None or not math.isfinite(value) or not 0.0 < value <= MAX_DECODE_TOKENS_PER_SECOND:
        return None
    return value


def _usable(value: float | None) -> bool:
    return value is not None and math.isfinite(value) and value >= 0.0


class PaceMeter:
    """The last counter reading per endpoint and model; `observe` gives the pace since the previous one."""

    def __init__(self) -> None:
        self._last: dict[PaceKey, _Reading] = {}

    def observe(
        self, key: PaceKey, generated: float | None, running: float | None, at: float
    ) -> float | None:
        """Tokens per second per running sequence since the previous reading of `key`, or None (see above)."""
        if generated is None or running is None or not (_usable(generated) and _usable(running)):
            self._last.pop(key, None)  # a gap in the readings: the next interval starts afresh
            return None
        prev = self._last.get(key)
        if prev is not None and at <= prev.at:
            return None  # the clock did not move: keep the older baseline
        self._last[key] = _Reading(at, generated, running)
        if prev is None or generated < prev.generated:
            return None  # first reading, or a counter reset: this one is the new baseline
        mean_running = (prev.running + running) / 2.0
        if mean_running <= 0.0:
            return None
        return plausible_pace((generated - prev.generated) / (at - prev.at) / mean_running)

    def forget(self, endpoint: str) -> None:
        """Drop an endpoint's baselines (its scrape failed or it left): its counter may restart meanwhile."""
        for key in [k for k in self._last if k[0] == endpoint]:
            del self._last[key]

    def __len__(self) -> int:
        return len(self._last)
