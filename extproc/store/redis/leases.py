"""Leases in Redis: acquire and release (one script call each), renewal, and the clean-up of calls whose
answer was lost.

Leases are members of per-(key, share) sorted sets scored by their expiry. The owning replica renews its open
leases every `lease_ttl_s / 3`; a replica that dies stops renewing and its leases drop out of every count
`lease_ttl_s` later. A lease that outlived its TTL without renewal (Redis unreachable for longer than the TTL)
is gone for good: renewing or settling it later is a no-op, never a revival. A lease *missing* before it can
have expired was lost by Redis (evicted, flushed): the renewal adds it back (`guard`), where it was (`P u`).

A release that fails is retried in the background (bounded) and otherwise left to lease expiry.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from extproc.core.limiter.limiter import Lease, Placement, Rejection
from extproc.core.limiter.split import key_tokens
from extproc.core.limiter.state import DEFAULT_HOLD_S, SHRUNK_RETRY_S, RateLimitStatus, tightest_status
from extproc.core.ports import StoreUnavailable
from extproc.store.redis.breaker import CLIENT_ERRORS, RedisUnavailable, RedisUnsafe
from extproc.store.redis.calls import BACKGROUND_TIMEOUT_S, Background, Calls
from extproc.store.redis.forget import RELEASE_RETRY_DELAYS_S, forget_lease, forget_placed
from extproc.store.redis.guard import StateGuard
from extproc.store.redis.keyspace import Keyspace, refusal
from extproc.store.redis.views import Views

log = logging.getLogger("extproc.store.redis")

LEASE_KEY_MARGIN_S = 10.0
"""Lease sets outlive their newest member by this much, then Redis drops the key."""

MAX_PENDING_RETRIES = 10_000
"""Bound on releases waiting for Redis; beyond it they are left to lease expiry."""

RESTORE_WITHIN = 0.9
"""A lease missing from Redis is re-added only while less than this fraction of its TTL has passed since this
replica last had it confirmed (acquired or renewed): within that time it cannot have expired, so Redis lost
it. Later it may have expired (Redis unreachable for longer than the TTL): it is then lost, never revived."""

RENEW_CHUNK = 500
"""Leases per RENEW call; the calls of one renewal are sent together."""


@dataclass
class Open:
    """A lease this replica holds: what to renew."""

    lease: Lease
    member: str
    confirmed_at: float
    """`time.monotonic()` when the last call that placed or renewed it was sent: Redis holds it until at
    least this plus the lease TTL, unless Redis lost it."""


class Leases:
    """This replica's leases in Redis."""

    def __init__(
        self,
        calls: Calls,
        keyspace: Keyspace,
        views: Views,
        guard: StateGuard,
        *,
        lease_ttl_s: float,
        timeout_s: float,
    ) -> None:
        self.calls = calls
        self.keyspace = keyspace
        self.views = views
        self.guard = guard
        self.background: Background = calls.background
        self.lease_ttl_s = lease_ttl_s
        self.renew_interval_s = lease_ttl_s / 3
        self.timeout_s = timeout_s
        self._ids = itertools.count(1)
        self.open: dict[int, Open] = {}
        self.lost_leases = 0
        """Leases found expired at renewal (Redis was unreachable for longer than the lease TTL)."""
        self.dropped_releases = 0
        """Releases given up after their retries, left to lease expiry."""
        self.restored_leases = 0
        """Leases re-added because Redis had lost them before their expiry."""

    def key_ttl_ms(self) -> int:
        return math.ceil((self.lease_ttl_s + LEASE_KEY_MARGIN_S) * 1000)

    # -- acquire -------------------------------------------------------------------------------------------

    async def acquire(
        self,
        keys: Sequence[str],
        tokens: int,
        holder: str | None = None,
        use_pool: bool = True,
        output_tokens: int = 0,
        adoption: bool = False,
    ) -> Lease | Rejection:
        """Take one slot on every key and each key's part of `tokens` (`output_tokens` of them completion:
        extproc/core/limiter/split.py `key_tokens`), all or nothing, in one script call. `adoption`: for a
        request admitted in the local fallback while Redis could not answer, which runs (`adopt`): placed
        in the first share it may use whatever is free there, a bucket going below zero where it must, off
        the request path (the background bound and lane, sent while the breaker fails fast).

        Raises `StoreUnavailable` when Redis does not answer within `timeout_s`, or cannot be trusted now.
        """
        if tokens < 0 or not 0 <= output_tokens <= tokens:
            raise ValueError("tokens must be >= 0, output_tokens between 0 and tokens")
        unique = tuple(dict.fromkeys(keys))
        lease_id = (self.calls.replica << 32) | next(self._ids)
        member = str(lease_id)
        if not unique:
            status = RateLimitStatus()
            return Lease(
                lease_id, unique, tokens, time.monotonic(), status, holder, reserved_output=output_tokens
            )
        self.guard.check_admission()
        head = [
            member,
            repr(self.lease_ttl_s),
            str(self.key_ttl_ms()),
            str(tokens),
            holder or "",
            "a" if adoption else "1" if use_pool else "0",
            repr(SHRUNK_RETRY_S if use_pool else DEFAULT_HOLD_S),
        ]
        parts = [str(key_tokens(key, tokens, output_tokens)) for key in unique]
        sent_at = time.monotonic()
        limit_s = BACKGROUND_TIMEOUT_S if adoption else self.timeout_s
        raw = await self._run_acquire(member, unique, holder, head, parts, limit_s, not adoption)
        code, index, now = int(raw[0]), int(raw[1]), float(raw[2])
        places, views = self.views.parse(unique, raw[3:], now, with_places=True)
        if code:
            key = unique[index - 1]
            status = tightest_status(unique, views, holder, now)
            part = key_tokens(key, tokens, output_tokens)
            return refusal(code, key, views[index - 1], status, holder, part, now, use_pool)
        placements = tuple(
            Placement(key, slot, tok or None) for key, (slot, tok) in zip(unique, places, strict=True)
        )
        lease = Lease(
            lease_id=lease_id,
            keys=unique,
            reserved_tokens=tokens,
            acquired_at=now,
            status=tightest_status(unique, views, holder, now),
            holder=holder,
            placements=placements,
            reserved_output=output_tokens,
        )
        self.open[lease_id] = Open(lease, member, sent_at)
        return lease

    async def adopt(self, lease: Lease) -> Lease:
        """Count in Redis a lease of the local fallback (`acquire`'s `adoption`), under a new member."""
        keys, tokens, output = lease.keys, lease.reserved_tokens, lease.reserved_output
        placed = await self.acquire(keys, tokens, lease.holder, True, output, adoption=True)
        if not isinstance(placed, Lease):  # the script places an adoption whatever is free: a bug
            raise RuntimeError(f"redis store: adoption refused ({placed.reason.value})")
        return placed

    async def _run_acquire(
        self,
        member: str,
        unique: tuple[str, ...],
        holder: str | None,
        head: list[str],
        parts: list[str],
        limit_s: float,
        fail_fast: bool,
    ) -> list[Any]:
        """The acquire script's reply within `limit_s`; what it placed without its reply arriving is taken
        back later."""
        try:
            raw: list[Any] = await self.calls.run(
                self.calls.scripts.acquire,
                lambda: [*head, *self.guard.admission_args(), *self.keyspace.keyspec(unique), *parts],
                unique,
                limit_s,
                fail_fast,
            )
        except RedisUnsafe:
            raise  # the script refused before placing anything
        except RedisUnavailable as exc:
            if exc.sent:  # the script may have run before the answer was lost: take back what it placed
                self.background.spawn(forget_lease(self.calls, member, unique, holder))
            raise
        except asyncio.CancelledError:  # cancelled while the script may be running
            self.background.spawn(forget_lease(self.calls, member, unique, holder))
            raise
        return raw

    # -- release -------------------------------------------------------------------------------------------

    async def release(self, lease: Lease, actual_tokens: int, actual_output: int = 0) -> bool:
        """Settle a lease to the tokens really used (`actual_output` of them completion), in one script call.

        False when it was settled before (by this process, or found already removed or expired in Redis).
        If Redis cannot be reached the settlement is retried in the background and True is returned: this
        call did settle the lease as far as the caller is concerned, and the slot comes back at the latest
        when the lease expires.
        """
        if lease.settled:
            return False
        lease.settled = True
        lease.actual_tokens = max(0, actual_tokens)
        lease.actual_output = max(0, actual_output)
        self.open.pop(lease.lease_id, None)
        if not lease.placements:
            return True
        head = [str(lease.lease_id), repr(lease.acquired_at)]
        tail: list[str] = []
        for placement in lease.placements:
            key = placement.key
            tail += [
                placement.slot,
                placement.tokens or "",
                str(lease.reserved_on(key)),
                str(lease.actual_on(key)),
            ]

        def args() -> list[str]:
            return [*head, *self.keyspace.keyspec(lease.keys), *tail]

        try:
            raw = await self.calls.run(self.calls.scripts.release, args, lease.keys, self.timeout_s)
        except (StoreUnavailable, asyncio.CancelledError):
            self._retry_release(args, lease.keys)
            return True
        now = float(raw[1])
        self.views.parse(lease.keys, raw[2:], now, with_places=False)
        return bool(int(raw[0]))

    def _retry_release(self, args: Callable[[], list[str]], keys: Sequence[str]) -> None:
        if len(self.background) >= MAX_PENDING_RETRIES:
            self.dropped_releases += 1
            return
        self.background.spawn(self._release_later(args, keys))

    async def _release_later(self, args: Callable[[], list[str]], keys: Sequence[str]) -> None:
        """Idempotent: the script settles only a lease still present, so a retry after a lost reply or after
        expiry is a no-op."""
        for delay in RELEASE_RETRY_DELAYS_S:
            await asyncio.sleep(delay)
            try:
                await self.calls.run(
                    self.calls.scripts.release, args, keys, BACKGROUND_TIMEOUT_S, fail_fast=False
                )
                return
            except StoreUnavailable:
                continue
        self.dropped_releases += 1
        log.warning("redis store: release given up, the lease will expire", extra={"lease": args()[0]})

    # -- renewal -------------------------------------------------------------------------------------------

    async def renew_loop(self) -> None:
        while not self.calls.closed:
            await asyncio.sleep(self.renew_interval_s)
            try:
                await self.renew()
            except StoreUnavailable:
                log.warning(
                    "redis store: lease renewal failed", extra={"error": self.calls.breaker.last_error}
                )
            except Exception:
                log.exception("redis store: lease renewal failed")

    async def renew(self) -> int:
        """Push the expiry of every open lease of this replica one TTL ahead; returns the number renewed.

        One script call per 500 leases, sent together. Leases found expired are dropped from the renewal set
        and counted in `lost_leases`; leases missing before they could expire are added back.
        """
        entries = list(self.open.values())
        if not entries:
            return 0
        chunks = [entries[i : i + RENEW_CHUNK] for i in range(0, len(entries), RENEW_CHUNK)]
        sent_at = time.monotonic()
        calls = [
            # Not in the background lane: a few calls per interval, and what keeps the leases counted, so
            # they never wait behind a backlog of release retries.
            self.calls.call(self.calls.scripts.renew, self._renew_args(chunk, sent_at))
            for chunk in chunks
        ]
        # Concurrent calls rather than a pipeline: the same code then serves one Redis and a Cluster (whose
        # pipeline does not take scripts the same way), and a NOSCRIPT reply is handled per call.
        try:
            async with asyncio.timeout(BACKGROUND_TIMEOUT_S):
                results = await asyncio.gather(*calls)
        except CLIENT_ERRORS as exc:
            self.calls.breaker.failed(exc)
            raise RedisUnavailable(f"redis: {self.calls.breaker.last_error}") from exc
        lost, restored = 0, 0
        for chunk, (lost_at, restored_at) in zip(chunks, results, strict=True):
            lost += self._drop_lost(chunk, lost_at)
            restored += self._keep_restored(chunk, restored_at)
        for entry in entries:
            if entry.lease.lease_id in self.open:
                entry.confirmed_at = sent_at
        if lost:
            self.lost_leases += lost
            log.warning("redis store: leases expired before renewal", extra={"lost": lost})
        if restored:
            self.restored_leases += restored
            self.guard.restored(restored)
        return len(entries) - lost

    def _renew_args(self, chunk: Sequence[Open], sent_at: float) -> list[str]:
        args = [repr(self.lease_ttl_s), str(self.key_ttl_ms()), str(len(chunk))]
        for entry in chunk:
            places = entry.lease.placements
            alive = sent_at < entry.confirmed_at + self.lease_ttl_s * RESTORE_WITHIN
            args += [entry.member, str(int(alive)), str(int(entry.lease.slot_released)), str(len(places))]
            for placement in places:
                args += [placement.key, placement.slot]
        return args

    def _drop_lost(self, chunk: Sequence[Open], indices: Sequence[int]) -> int:
        lost = 0
        for index in indices:
            if self.open.pop(chunk[int(index) - 1].lease.lease_id, None) is not None:
                lost += 1
        return lost

    def _keep_restored(self, chunk: Sequence[Open], indices: Sequence[int]) -> int:
        restored = 0
        for index in indices:
            entry = chunk[int(index) - 1]
            if entry.lease.lease_id in self.open:
                restored += 1
            else:  # settled while the renewal was on its way: its release ran first, undo the re-add
                self.background.spawn(forget_placed(self.calls, entry.member, entry.lease.placements))
        return restored
