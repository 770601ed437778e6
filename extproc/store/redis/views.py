"""The keys as last read from Redis: what `snapshot()` serves at metrics scrape time without any I/O.

The cache is refreshed after every call on a key and every `refresh_s` by a background task (PEEK, which
also stores buckets at the old capacities and then the new ones around a limit or scale change, so that a
change starts from the level a bucket really had, as the in-process limiter does).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

from extproc.core.limiter.limiter import EAGER_KEYS, SNAPSHOT_BUSIEST_KEYS
from extproc.core.limiter.state import KeySnapshot, KeyState
from extproc.core.ports import StoreUnavailable
from extproc.store.redis.calls import BACKGROUND_TIMEOUT_S, Calls
from extproc.store.redis.keyspace import CACHE_MAX_KEYS, Keyspace

log = logging.getLogger("extproc.store.redis")

CACHE_IDLE_S = 300.0
"""Keys past the first `EAGER_KEYS` configured ones (tenants) leave the metrics cache this long unseen."""

SYNC_BATCH_KEYS = 256
"""Keys per PEEK call when a reload stores or resizes buckets or the cache is refreshed: the event loop and
Redis serve other calls between batches, however many keys a config names."""


@dataclass
class Cached:
    view: KeyState  # the key as last read from Redis; turned into a KeySnapshot only at scrape time
    seen_at: float


class Views:
    """The metrics cache and the PEEK reads that fill it."""

    def __init__(self, calls: Calls, keyspace: Keyspace, timeout_s: float) -> None:
        self.calls = calls
        self.keyspace = keyspace
        self.timeout_s = timeout_s
        self.entries: dict[str, Cached] = {}
        self.server_time = 0.0
        """Redis server time of the last state read (what the last decision was judged at)."""

    def remember(self, keys: Sequence[str], views: Sequence[KeyState], now: float) -> None:
        self.server_time = max(self.server_time, now)
        seen = time.monotonic()
        for key, view in zip(keys, views, strict=True):
            self.entries.pop(key, None)  # re-insert: the dict stays ordered by last use
            self.entries[key] = Cached(view, seen)
        if len(self.entries) > CACHE_MAX_KEYS + len(self.keyspace.eager):
            eager = self.keyspace.eager
            extra = [k for k in self.entries if k not in eager][: len(self.entries) - CACHE_MAX_KEYS]
            for key in extra:
                del self.entries[key]

    def parse(
        self, keys: Sequence[str], raw: list[object], now: float, with_places: bool
    ) -> tuple[list[tuple[str, str]], list[KeyState]]:
        """A script's per-key states, judged at the scales of the call just answered; remembered."""
        places, views = self.keyspace.parse_states(keys, raw, now, self.calls.judged, with_places)
        self.remember(keys, views, now)
        return places, views

    def snapshot(self) -> list[KeySnapshot]:
        """The first `EAGER_KEYS` configured keys and the `SNAPSHOT_BUSIEST_KEYS` other cached keys holding
        the most leases, as `JointLimiter.shown_keys` picks them."""
        eager = self.keyspace.eager
        others = (k for k in self.entries if k not in eager)
        ranked = heapq.nlargest(SNAPSHOT_BUSIEST_KEYS, others, key=lambda k: self.entries[k].view.active)
        shown = [
            *(k for k in itertools.islice(self.keyspace.specs, EAGER_KEYS) if k in self.entries),
            *ranked,
        ]
        return [self.entries[key].view.snapshot(key) for key in shown]

    async def read(self, keys: list[str], mode: str, background: bool) -> tuple[list[KeyState], float]:
        """One PEEK call (mode "0", "fill" or "resize", see `scripts.PEEK`); updates the cache."""
        timeout = BACKGROUND_TIMEOUT_S if background else self.timeout_s
        raw = await self.calls.run(
            self.calls.scripts.peek,
            lambda: [mode, *self.keyspace.keyspec(keys)],
            keys,
            timeout,
            fail_fast=not background,
        )
        now = float(raw[0])
        _, views = self.parse(keys, raw[1:], now, with_places=False)
        return views, now

    async def sync(self, keys: list[str], mode: str) -> None:
        """Store the keys' buckets at the capacities in force (`fill`) or resize them (`resize`), in batches
        of `SYNC_BATCH_KEYS`. Best effort: Redis down is logged."""
        if not keys or (mode == "fill" and not self.keyspace.configured):
            return  # a replica that has no config yet knows no capacities to fill at
        try:
            await self.read_batched(keys, mode)
        except StoreUnavailable:
            log.warning(
                "redis store: limits applied locally, Redis not updated yet", extra={"keys": len(keys)}
            )

    async def read_batched(self, keys: list[str], mode: str) -> None:
        for start in range(0, len(keys), SYNC_BATCH_KEYS):
            await self.read(keys[start : start + SYNC_BATCH_KEYS], mode, background=True)

    def known_keys(self) -> list[str]:
        """The first `EAGER_KEYS` configured keys and keys seen lately, after forgetting the others idle for
        `CACHE_IDLE_S`."""
        cutoff = time.monotonic() - CACHE_IDLE_S
        eager = self.keyspace.eager
        for key in [k for k, c in self.entries.items() if k not in eager and c.seen_at < cutoff]:
            del self.entries[key]
        return list(dict.fromkeys([*itertools.islice(self.keyspace.specs, EAGER_KEYS), *self.entries]))

    async def refresh(self) -> None:
        """Re-read the keys `known_keys` names into the metrics cache; forget idle tenants."""
        keys = self.known_keys()
        if keys:
            await self.read_batched(keys, "0")
