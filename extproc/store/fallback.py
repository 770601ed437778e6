"""A shared store with a local fallback: when Redis cannot answer, each replica admits on its own share.

A gateway fleet that loses its shared store has two bad options: refuse everything (every request fails
while Redis is down) or admit everything (the KV cache overflows). The middle way is what this wrapper does:
each replica falls back to in-process limits sized to its share of every limit (`fallback_share`, e.g.
1/replicas), so the fleet as a whole stays near its limits while Redis is away, and goes back to the shared
limits as soon as Redis answers again. Leases remember where they were taken and are settled there.

The replica's own shared leases count against its share too: every shared lease also holds a slot in the
local limiter (a shadow, no tokens) while that slot is free. Without it, a replica falling back with its
shared leases still running would admit its whole share on top of them, and the fleet could run up to twice
its limit while Redis is away (the soak benchmark saw this whenever a Redis call timed out under load). With
it a replica in fallback admits only up to its share minus what it already runs, so the fleet stays at its
limit as long as the replicas held about equal parts of it.

The way back has the mirror problem: requests admitted in the fallback are not counted in Redis, so the other
replicas would admit beside them as if they were not running, for as long as they run (minutes, for a long
answer; the engine tier's fleet saw the engine run one more request than Redis held, for 5 s, after one
acquire timed out under load). So once Redis answers again, each of them is adopted: placed in Redis as a
shared lease whatever is free there (`Adopting.adopt`; it already runs), its local lease kept as its shadow
and settled with it. Until every one is adopted, a replica admits a request only if the shared store admits
it and its shadow finds a local slot, so it stays within its share meanwhile. An adoption that fails is tried
again every second until each is adopted or has ended.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Protocol, runtime_checkable

from extproc.core.limiter.limiter import KeySnapshot, Lease, LimitSpec, RateLimitStatus, Rejection
from extproc.core.ports import KvBoard, LimiterStore, Mailbox, StoreHealth, StoreUnavailable
from extproc.store.local import LocalStore

log = logging.getLogger(__name__)

ADOPT_RETRY_S = 1.0
"""How often a replica tries again to hand the leases it took in the fallback to the shared store: twice the
breaker's fail-fast window, so a store that is back is found within about a second."""


def share_of(spec: LimitSpec, share: float) -> LimitSpec:
    """A limit cut to `share` of itself (guarantees too); a non-zero slot limit keeps at least one slot."""

    def slots(value: int | None) -> int | None:
        return None if value is None else (0 if value == 0 else max(1, math.floor(value * share)))

    def tokens(value: int | None) -> int | None:
        return None if value is None else max(1, math.floor(value * share))

    guaranteed = tuple((name, share_of(g, share)) for name, g in spec.guaranteed)
    out = LimitSpec(
        max_concurrency=slots(spec.max_concurrency), tokens_per_minute=tokens(spec.tokens_per_minute)
    )
    # Rounding each guarantee up to one slot may overshoot a small total: drop guarantees that no longer fit.
    try:
        return LimitSpec(out.max_concurrency, out.tokens_per_minute, guaranteed)
    except ValueError:
        return out


@runtime_checkable
class Adopting(Protocol):
    """A shared store that can take over a lease admitted elsewhere (`RedisStore`)."""

    async def adopt(self, lease: Lease) -> Lease:
        """The shared lease that now counts `lease` (same keys, tokens and holder), placed whatever is
        free; raises `StoreUnavailable` when the store cannot answer."""
        ...


class FallbackStore:
    """`LimiterStore` that prefers `primary` and uses `fallback` (local, cut to a share) when it fails."""

    def __init__(self, primary: LimiterStore, fallback: LocalStore, share: float) -> None:
        if not 0 < share <= 1:
            raise ValueError("fallback_share: must be in (0, 1]")
        self.primary = primary
        self.fallback = fallback
        self.share = share
        self._local: dict[int, Lease] = {}  # leases taken in the fallback, by id
        self._shadows: dict[int, Lease] = {}  # local slot held for a shared lease, by the shared lease's id
        self._adopted: dict[int, Lease] = {}  # the shared lease that took over a fallback lease, by its id
        self._adopting: asyncio.Task[None] | None = None
        self._closed = False
        self.fallback_acquires = 0
        self.adoptions = 0
        self.degraded = False

    async def acquire(
        self,
        keys: Sequence[str],
        tokens: int,
        holder: str | None = None,
        use_pool: bool = True,
        output_tokens: int = 0,
    ) -> Lease | Rejection:
        try:
            result = await self.primary.acquire(keys, tokens, holder, use_pool, output_tokens)
        except StoreUnavailable as exc:
            if not self.degraded:
                log.error(
                    "shared store unavailable: admitting on this replica's share", extra={"error": str(exc)}
                )
            self.degraded = True
            self.fallback_acquires += 1
            result = await self.fallback.acquire(keys, tokens, holder, use_pool, output_tokens)
            if isinstance(result, Lease):
                self._local[id(result)] = result
                self._adopt_soon()
            return result
        if self.degraded:
            log.info("shared store answering again: back to shared limits")
            self.degraded = False
        if isinstance(result, Lease) and result.placements:
            shadow = await self.fallback.acquire(keys, 0, holder, use_pool)
            if isinstance(shadow, Lease):
                self._shadows[id(result)] = shadow
            elif self._local:  # requests admitted in the fallback still run, uncounted in Redis
                await self.primary.release(result, 0)
                return shadow
        return result

    def _adopt_soon(self) -> None:
        """Adopt the fallback's leases into the shared store, in the background, until none is left (one
        task at a time)."""
        busy = self._adopting is not None and not self._adopting.done()
        if self._closed or busy or not isinstance(self.primary, Adopting):
            return
        self._adopting = asyncio.ensure_future(self._adopt(self.primary))

    async def _adopt(self, primary: Adopting) -> None:
        """Passes over the fallback's open leases, `ADOPT_RETRY_S` apart, until each is adopted or has
        ended: the first pass runs at once, and finds the store back already where it lost one answer."""
        while self._local:
            before = self.adoptions
            await self._adopt_each(primary)
            if self.adoptions > before:
                log.info(
                    "leases admitted in the fallback now counted in the shared store",
                    extra={"adopted": self.adoptions - before, "left": len(self._local)},
                )
            if self._local:
                await asyncio.sleep(ADOPT_RETRY_S)

    async def _adopt_each(self, primary: Adopting) -> None:
        """Each lease taken in the fallback and still open becomes a shared one; the local lease stays as
        its shadow slot. One settled while its adoption was in flight gives the shared lease straight
        back, charged what it used (the shared limits count the request). Stops at the first failure."""
        for key, lease in list(self._local.items()):
            try:
                shared = await primary.adopt(lease)
            except StoreUnavailable:
                return
            except Exception:
                log.exception("adopting a fallback lease into the shared store failed")
                return
            if self._local.pop(key, None) is None:
                await self.primary.release(shared, lease.actual_tokens or 0, lease.actual_output)
                continue
            self._adopted[key] = shared
            self.adoptions += 1
            if lease.slot_released:
                await self.primary.release_slot(shared)

    async def release(self, lease: Lease, actual_tokens: int, actual_output: int = 0) -> bool:
        shared = self._adopted.pop(id(lease), None)
        if shared is not None:  # the shadow's local slot and tokens back; the shared lease is charged
            await self.fallback.release(lease, 0)
            return await self.primary.release(shared, actual_tokens, actual_output)
        if self._local.pop(id(lease), None) is not None:
            return await self.fallback.release(lease, actual_tokens, actual_output)
        shadow = self._shadows.pop(id(lease), None)
        if shadow is not None:
            await self.fallback.release(shadow, 0)
        return await self.primary.release(lease, actual_tokens, actual_output)

    async def release_slot(self, lease: Lease) -> bool:
        """The slots where the lease took them; a shared lease's local shadow slot goes with its shared
        ones (only once those are back: a shared store that cannot answer keeps both)."""
        if id(lease) in self._local:
            return await self.fallback.release_slot(lease)
        shared = self._adopted.get(id(lease))
        if shared is not None:
            if not await self.primary.release_slot(shared):
                return False
            return await self.fallback.release_slot(lease)
        if not await self.primary.release_slot(lease):
            return False
        shadow = self._shadows.pop(id(lease), None)
        if shadow is not None:
            await self.fallback.release(shadow, 0)
        return True

    async def refund(self, lease: Lease, tokens: int) -> bool:
        if id(lease) in self._local:
            return await self.fallback.refund(lease, tokens)
        shared = self._adopted.get(id(lease))
        if shared is not None:  # its shadow's tokens go back whole at its release
            return await self.primary.refund(shared, tokens)
        return await self.primary.refund(lease, tokens)  # the local shadow holds a slot, no tokens

    async def status(self, keys: Sequence[str], holder: str | None = None) -> RateLimitStatus:
        try:
            return await self.primary.status(keys, holder)
        except StoreUnavailable:
            return await self.fallback.status(keys, holder)

    async def apply_limits(
        self,
        specs: Mapping[str, LimitSpec],
        defaults: Mapping[str, LimitSpec] | None = None,
        priority: Sequence[str] = (),
    ) -> None:
        await self.primary.apply_limits(specs, defaults, priority)
        await self.fallback.apply_limits(
            {k: share_of(v, self.share) for k, v in specs.items()},
            {k: share_of(v, self.share) for k, v in (defaults or {}).items()},
            priority,
        )

    async def set_scale(self, key: str, scale: float) -> None:
        await self.primary.set_scale(key, scale)
        await self.fallback.set_scale(key, scale)

    def propose_scale(self, key: str, scale: float) -> None:
        self.primary.propose_scale(key, scale)
        self.fallback.propose_scale(key, scale)

    def on_wake(self, callback: Callable[[], None]) -> None:
        """Wake-ups from the shared store (capacity freed on another replica); none from the fallback."""
        self.primary.on_wake(callback)

    def announce_waiting(self) -> None:
        self.primary.announce_waiting()

    async def start(self) -> None:
        await self.primary.start()

    async def close(self) -> None:
        """Stop adopting (the leases left to their TTL in the fallback), then close the shared store."""
        self._closed = True
        task = self._adopting
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.primary.close()

    def prune(self) -> int:
        return self.primary.prune() + self.fallback.prune()

    def mailbox(self, own: str) -> Mailbox | None:
        """The shared store's: the replicas share it whether or not this one has fallen back for now."""
        return self.primary.mailbox(own)

    def kv_board(self) -> KvBoard | None:
        """The shared store's: while it cannot answer, each KV budget books on its fallback share."""
        return self.primary.kv_board()

    def health(self) -> StoreHealth:
        shared = self.primary.health()
        return replace(
            shared,
            available=shared.available and not self.degraded,
            fallback_acquires=shared.fallback_acquires + self.fallback_acquires,
            fallback_leases=len(self._local),
        )

    def snapshot(self) -> list[KeySnapshot]:
        return self.fallback.snapshot() if self.degraded else self.primary.snapshot()
