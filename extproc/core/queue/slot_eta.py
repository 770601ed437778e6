"""When will a slot free? A `retry-after` a client can trust, computed from the leases actually open.

A hint from an average hold time (`hold / limit`) is wrong exactly when it matters: eight slots taken at
once by 400-token answers free together, four seconds later, while `hold / limit` says 125 ms and a client
that follows it spends its retries in the first second. So each open lease's remaining time is estimated
from what it is doing:

    remaining = (expected completion - tokens streamed so far) / the pool's decode rate

per sequence, where the expected completion is its allowance times the tenant's learned completion ratio
(the KV budget's robust per-tenant quantile; the whole allowance when unknown). A lease that has outrun its
expectation is given a short, non-zero remainder rather than none.

Successive refused clients must not all come back at the same instant for the same slot (a herd), so the
n-th hint handed out for a key within the current horizon points at the n-th slot expected to free, and a
little jitter (never earlier) spreads clients aiming at the same slot.

Pure: callers pass `now` and a random source.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

MIN_REMAINING_S = 0.05
"""The least time a still-open lease is expected to take: it has not ended yet."""

OVERRUN_TOKENS = 16.0
"""Tokens assumed left for a lease that has already streamed more than expected."""

MAX_KEYS = 4096
"""Keys whose hint history is kept."""

MAX_HINT_S = 60.0
"""OpenAI's SDKs honour `retry-after` only up to 60 s; a longer wait is the same as no hint to them."""


def hint_within(eta_s: float | None, floor_s: float) -> float:
    """A forecast as a refusal's `retry-after`: `floor_s` where there is none or it says sooner (a client
    told "now" spends its retries at once), at most what SDKs honour (`MAX_HINT_S`)."""
    return floor_s if eta_s is None else min(MAX_HINT_S, max(floor_s, eta_s))


@dataclass(frozen=True, slots=True)
class OpenLease:
    """What the estimate needs of one open request (per sequence; the rate in tokens per second)."""

    expected_tokens: float
    streamed_tokens: float
    rate: float
    ended: bool = False  # the request ended at the proxy; its slot frees when the sidecar hears of it

    def remaining_s(self) -> float:
        if self.ended:
            return MIN_REMAINING_S
        left = self.expected_tokens - self.streamed_tokens
        if left <= 0:
            left = OVERRUN_TOKENS
        return max(MIN_REMAINING_S, left / max(self.rate, 1e-6))


def remaining_times(leases: Sequence[OpenLease]) -> list[float]:
    """The open leases' remaining times, soonest first."""
    return sorted(lease.remaining_s() for lease in leases)


@dataclass
class RetryHints:
    """Hands out slot ETAs per key so that successive refused clients aim at successive slots."""

    jitter: float = 0.15
    rand: Callable[[], float] = random.random
    _issued: dict[str, deque[float]] = field(default_factory=dict)

    def hint(self, key: str, etas: Sequence[float], now: float) -> float | None:
        """Seconds until a slot of `key` is expected to free for this caller, from the open leases' sorted
        remaining times (`remaining_times`); None without open leases."""
        if not etas:
            return None
        if key not in self._issued and len(self._issued) >= MAX_KEYS:
            self._issued.clear()  # bounded memory: forgetting only makes the next hints aim earlier slots
        issued = self._issued.setdefault(key, deque())
        horizon = now - etas[-1]
        while issued and issued[0] < horizon:
            issued.popleft()
        # Hints still pending within the horizon are clients already aiming at the earliest slots.
        index = min(len(etas) - 1, len(issued))
        issued.append(now)
        eta = etas[index] * (1.0 + self.jitter * self.rand())
        return min(MAX_HINT_S, eta)
