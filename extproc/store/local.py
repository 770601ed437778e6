"""The default store: limiter state in this process, no external service.

Every call runs on the event loop thread and completes without awaiting, so acquire and release are atomic
with respect to each other without locks.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from extproc.core.clock import Clock, monotonic
from extproc.core.limiter.limiter import (
    JointLimiter,
    KeySnapshot,
    Lease,
    LimitSpec,
    RateLimitStatus,
    Rejection,
)
from extproc.core.ports import KvBoard, Mailbox, StoreHealth


class LocalStore:
    """`LimiterStore` backed by an in-process `JointLimiter`."""

    def __init__(self, clock: Clock = monotonic) -> None:
        self.limiter = JointLimiter(clock=clock)

    async def acquire(
        self,
        keys: Sequence[str],
        tokens: int,
        holder: str | None = None,
        use_pool: bool = True,
        output_tokens: int = 0,
    ) -> Lease | Rejection:
        return self.limiter.acquire(keys, tokens, holder, use_pool, output_tokens)

    async def release(self, lease: Lease, actual_tokens: int, actual_output: int = 0) -> bool:
        return self.limiter.release(lease, actual_tokens, actual_output)

    async def release_slot(self, lease: Lease) -> bool:
        return self.limiter.release_slot(lease)

    async def refund(self, lease: Lease, tokens: int) -> bool:
        return self.limiter.refund(lease, tokens)

    async def status(self, keys: Sequence[str], holder: str | None = None) -> RateLimitStatus:
        return self.limiter.status(keys, holder)

    async def apply_limits(
        self,
        specs: Mapping[str, LimitSpec],
        defaults: Mapping[str, LimitSpec] | None = None,
        priority: Sequence[str] = (),
    ) -> None:
        self.limiter.apply_limits(specs, defaults, priority)

    async def set_scale(self, key: str, scale: float) -> None:
        self.limiter.set_scale(key, scale)

    def propose_scale(self, key: str, scale: float) -> None:
        self.limiter.set_scale(key, scale)

    def snapshot(self) -> list[KeySnapshot]:
        """The keys metrics show (`JointLimiter.shown_keys`): bounded, however many tenants are in use."""
        return self.limiter.snapshot(self.limiter.shown_keys())

    def prune(self) -> int:
        return self.limiter.prune()

    async def start(self) -> None:
        """Nothing to connect to."""

    async def close(self) -> None:
        """Nothing to disconnect."""

    def on_wake(self, callback: Callable[[], None]) -> None:
        """Releases happen in this process: the caller's own queue sees them."""

    def announce_waiting(self) -> None:
        """No other replica shares this state."""

    def health(self) -> StoreHealth:
        return StoreHealth(available=True)

    def mailbox(self, own: str) -> Mailbox | None:
        """None: the state is this process's own, so no other replica shares it."""
        return None

    def kv_board(self) -> KvBoard | None:
        """None: no other replica shares this state (each KV budget books its configured share)."""
        return None
