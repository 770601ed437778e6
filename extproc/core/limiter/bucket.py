"""A tokens-per-minute bucket that can be refunded and can go into debt.

Admission reserves prompt tokens plus the completion budget up front; when the response ends the lease is
settled against what was really produced. Unused reservation flows back (never above capacity, so a refund
cannot mint burst capacity that was never earned), and an overrun is charged as debt: the bucket goes
negative and later requests wait until refill pays it off. That keeps the long-run rate exact even when
backends ignore `max_tokens`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

EPSILON_TOKENS = 1e-6
"""Float slack: after waiting exactly the advertised time, rounding must not leave a request a hair short."""


@dataclass
class TokenBucket:
    """State of one bucket. Capacity is the effective tokens-per-minute (base limit times adaptive scale)."""

    capacity: float
    tokens: float
    updated_at: float

    @classmethod
    def full(cls, capacity: float, now: float) -> TokenBucket:
        if capacity <= 0:
            raise ValueError("bucket capacity must be positive")
        return cls(capacity=float(capacity), tokens=float(capacity), updated_at=now)

    @property
    def rate_per_second(self) -> float:
        return self.capacity / 60.0

    def refill(self, now: float) -> None:
        """Credit the tokens earned since the last update; a clock that went back credits nothing."""
        elapsed = now - self.updated_at
        if elapsed > 0:
            self.tokens = min(self.capacity, self.tokens + elapsed * self.rate_per_second)
            self.updated_at = now

    def wait_for(self, amount: float, now: float) -> float:
        """Seconds until `amount` tokens are available: 0 if now, `inf` if it can never fit."""
        self.refill(now)
        if amount > self.capacity:
            return math.inf
        missing = amount - self.tokens
        if missing <= EPSILON_TOKENS:
            return 0.0
        return missing / self.rate_per_second

    def take(self, amount: float, now: float) -> None:
        """Remove tokens unconditionally; the caller has checked `wait_for` first."""
        self.refill(now)
        self.tokens -= amount

    def settle(self, reserved: float, actual: float, now: float) -> float:
        """Correct a reservation to the actual amount. Returns tokens refunded (negative: debt charged)."""
        self.refill(now)
        delta = reserved - actual
        if delta > 0:
            refunded = min(delta, self.capacity - self.tokens)
            refunded = max(refunded, 0.0)
            self.tokens += refunded
            return refunded
        self.tokens += delta
        return delta

    def resize(self, capacity: float, now: float) -> None:
        """Apply a new effective capacity: tokens above it are dropped, debt is kept."""
        if capacity <= 0:
            raise ValueError("bucket capacity must be positive")
        self.refill(now)
        self.capacity = float(capacity)
        self.tokens = min(self.tokens, self.capacity)

    def remaining(self, now: float) -> int:
        self.refill(now)
        return max(0, math.floor(self.tokens))

    def seconds_until_full(self, now: float) -> float:
        self.refill(now)
        return max(0.0, (self.capacity - self.tokens) / self.rate_per_second)
