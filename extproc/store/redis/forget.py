"""Taking back what a lease script placed where its caller cannot keep it (the FORGET script): an acquire
whose answer was lost (it may have run), and a renewal's re-add that crossed the lease's release. Both are
background work: bounded by the background call bound, never on a request's path."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence

from extproc.core.limiter.limiter import Placement
from extproc.core.limiter.shares import SHARED
from extproc.core.ports import StoreUnavailable
from extproc.store.redis.calls import BACKGROUND_TIMEOUT_S, Calls

RELEASE_RETRY_DELAYS_S = (0.1, 0.5, 1.0, 2.0, 4.0, 8.0)
"""Backoff between attempts of a release (or a clean-up) that could not reach Redis."""


async def forget_lease(calls: Calls, member: str, keys: Sequence[str], holder: str | None) -> None:
    """An acquire (or adoption) whose answer was lost: the member out of every share it could be in (its
    holder's and the pool), retried on the release backoff. Tokens it may have taken stay charged."""
    pairs: list[str] = []
    for key in keys:
        for share in dict.fromkeys([holder or SHARED, SHARED]):
            pairs += [key, share]
    for delay in RELEASE_RETRY_DELAYS_S:
        await asyncio.sleep(delay)
        try:
            await calls.run(
                calls.scripts.forget, lambda: [member, *pairs], (), BACKGROUND_TIMEOUT_S, fail_fast=False
            )
            return
        except StoreUnavailable:
            continue


async def forget_placed(calls: Calls, member: str, placements: Sequence[Placement]) -> None:
    """A renewal re-added a lease settled meanwhile: the member out of the shares it was placed in, once."""
    pairs = [part for p in placements for part in (p.key, p.slot)]
    with contextlib.suppress(StoreUnavailable):
        await calls.run(
            calls.scripts.forget, lambda: [member, *pairs], (), BACKGROUND_TIMEOUT_S, fail_fast=False
        )
