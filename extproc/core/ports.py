"""The interface a limiter state store implements.

The ext_proc server talks to limits only through `LimiterStore`. The in-process store (the default) keeps
state in this process; a shared store lets several gateway replicas enforce one global limit. Both settle a
lease exactly once, whoever asks first.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from extproc.core.limiter import KeySnapshot, Lease, LimitSpec, RateLimitStatus, Rejection


class StoreUnavailable(Exception):
    """The store could not answer in time (a shared store down or unreachable); nothing was admitted."""


class LimiterStore(Protocol):
    async def acquire(
        self, keys: Sequence[str], tokens: int, holder: str | None = None, use_pool: bool = True
    ) -> Lease | Rejection:
        """Take one slot on every key and `tokens` from every bucket, all or nothing, as class `holder`.

        With `use_pool=False` only the class's own guarantee may be used, not the burstable pool.
        """
        ...

    async def release(self, lease: Lease, actual_tokens: int) -> bool:
        """Settle a lease to the tokens really used; False when it was settled before."""
        ...

    async def status(self, keys: Sequence[str], holder: str | None = None) -> RateLimitStatus:
        """The tightest remaining capacity over `keys`, for response headers."""
        ...

    async def apply_limits(
        self,
        specs: Mapping[str, LimitSpec],
        defaults: Mapping[str, LimitSpec] | None = None,
        priority: Sequence[str] = (),
    ) -> None:
        """Install new base limits and the class priority order (config reload); open leases are kept."""
        ...

    async def set_scale(self, key: str, scale: float) -> None:
        """Scale a key's base limits (adaptive feedback)."""
        ...

    def snapshot(self) -> list[KeySnapshot]:
        """Current state of every known key, for metrics."""
        ...
