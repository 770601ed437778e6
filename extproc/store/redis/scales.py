"""One adaptive scale per key for every replica: each proposes its own, Redis keeps the lowest fresh one.

Every replica proposes a scale from its own KV feed; the SCALE script stores the effective scale (the
minimum of the fresh proposals) and every script refuses capacities computed at another scale (the caller
adopts the stored one and calls again, `calls`). So all replicas admit at one scale at every decision.
"""

from __future__ import annotations

import asyncio
import logging
import math

from extproc.core.ports import StoreUnavailable
from extproc.store.redis.calls import BACKGROUND_TIMEOUT_S, Calls
from extproc.store.redis.keyspace import Keyspace
from extproc.store.redis.views import Views
from extproc.store.redis.wake import Wake

log = logging.getLogger("extproc.store.redis")

SCALE_PROPOSAL_TTL_S = 15.0
SCALE_REFRESH_S = 5.0
"""A replica re-sends its scale proposals this often; a proposal not re-sent (a dead replica's) stops
counting after the TTL. Until then a dead replica can only keep limits lower, never higher."""


class Scales:
    """This replica's scale proposals and the effective scales it adopts."""

    def __init__(self, calls: Calls, keyspace: Keyspace, views: Views, wake: Wake) -> None:
        self.calls = calls
        self.keyspace = keyspace
        self.views = views
        self.wake = wake
        self.proposed: dict[str, float] = {}  # this replica's own proposals, re-sent every SCALE_REFRESH_S
        calls.on_stale = keyspace.adopt_scales
        calls.scale_of = keyspace.effective_scale

    async def set_scale(self, key: str, scale: float) -> None:
        """Propose this replica's scale for a key (from its KV feed); 1 withdraws the proposal.

        The scale every replica then admits at is the stored effective one, the minimum of the fresh
        proposals. Best effort: Redis down is logged; the proposal is re-sent every `SCALE_REFRESH_S` anyway.
        """
        if not 0 < scale <= 1:
            raise ValueError("scale must be in (0, 1]")
        if self.proposed.get(key) == scale:
            return
        self.proposed[key] = scale
        try:
            await self.propose(key, scale)
        except StoreUnavailable:
            log.warning("redis store: scale proposal not stored yet", extra={"key": key})

    def propose_scale(self, key: str, scale: float) -> None:
        """`set_scale` from synchronous code: the proposal is sent in the background, then local waiters are
        woken (a raised scale may admit them)."""
        self.calls.background.spawn(self._propose_and_wake(key, scale))

    async def _propose_and_wake(self, key: str, scale: float) -> None:
        await self.set_scale(key, scale)
        for callback in self.wake.callbacks:
            callback()

    async def propose(self, key: str, scale: float) -> None:
        """One SCALE call; when the effective scale changed, resize the key's buckets to it (the script
        stored them at the old capacities first), as the in-process limiter does on a scale change."""
        ttl_ms = str(math.ceil(SCALE_PROPOSAL_TTL_S * 1000))
        raw = await self.calls.run(
            self.calls.scripts.scale,
            lambda: [str(self.calls.replica), repr(scale), ttl_ms, *self.keyspace.keyspec([key])],
            [key],
            BACKGROUND_TIMEOUT_S,
            fail_fast=False,
        )
        before, after = float(raw[0]), float(raw[1])
        self.keyspace.adopt_scales([key], [after])
        if after != before:
            await self.views.sync([key], "resize")
            if after > before:
                self.wake.notify()

    async def repropose(self) -> None:
        """Send every proposal again now (Redis lost them); raises `StoreUnavailable`."""
        self.keyspace.forget_scales()
        for key, scale in list(self.proposed.items()):
            await self.propose(key, scale)

    async def loop(self) -> None:
        """Re-send this replica's proposals, so they stay fresh and expired ones of dead replicas age out."""
        while not self.calls.closed:
            await asyncio.sleep(SCALE_REFRESH_S)
            for key, scale in list(self.proposed.items()):
                try:
                    await self.propose(key, scale)
                except StoreUnavailable:
                    break
                except Exception:
                    log.exception("redis store: scale proposal failed")
