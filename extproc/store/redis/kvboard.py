"""The KV-budget figures of each pool, shared between the replicas of one Redis (`core.kv_fleet`).

Each replica stores its own figures of a pool and reads the sum of the others' in one KV_POOL call
(`scripts`): the figures live in one hash per pool, a field per replica with its expiry in server time, so a
replica that dies stops holding KV in the others' budgets `REPLICA_TTL_S` after its last publication and no
replica's clock decides it. Background work: the call runs in the background lane, never on a request's path.

Beside them, each replica's runs of a pool as its engine tally sums them (`EngineTally.figures`), exchanged
the same way in a hash of their own (`RUNS_POOL`, `scripts`): the charge tally splits the pool's generated
tokens against every replica's runs, not its own alone.
"""

from __future__ import annotations

import math
import zlib

from extproc.core.engine.tally import RunFigures
from extproc.core.kv.fleet import FREE_HORIZONS_S, REPLICA_TTL_S, Peers, ReplicaShare
from extproc.store.redis.calls import BACKGROUND_TIMEOUT_S, Calls

HORIZONS_MS = tuple(round(horizon * 1000) for horizon in FREE_HORIZONS_S)
HORIZONS_ID = zlib.crc32(" ".join(map(str, HORIZONS_MS)).encode())
"""Stored with a replica's frees: a replica of a version with other horizons does not read them as its own."""
HORIZONS = (len(FREE_HORIZONS_S), HORIZONS_ID, *HORIZONS_MS)
"""What every KV_POOL call sends before its frees: how many horizons, their id, and each in ms."""


class RedisKvBoard:
    """`KvBoard` on the store's Redis and key prefix."""

    def __init__(self, calls: Calls) -> None:
        self.calls = calls

    async def exchange(self, pool: str, share: ReplicaShare) -> Peers:
        """One KV_POOL call; raises the store's `StoreUnavailable` (`RedisUnavailable`) when Redis does not
        answer within the background bound."""
        ttl_ms = str(math.ceil(REPLICA_TTL_S * 1000))
        figures = (*share.fields(), share.heard_ms, *HORIZONS, *share.frees, share.head_ms)
        args = [pool, str(self.calls.replica), ttl_ms, *(str(max(0, int(v))) for v in figures)]
        raw = await self.calls.run(
            self.calls.scripts.kv_pool, lambda: args, [], BACKGROUND_TIMEOUT_S, fail_fast=False
        )
        values = [int(v) for v in raw]
        horizons = len(FREE_HORIZONS_S)
        frees = tuple(values[8 : 8 + horizons])
        booked, held, settled, candidates, yielding = values[1:6]
        others = ReplicaShare(booked, held, settled, candidates, yielding, frees=frees)
        bound, heard_all = values[8 + horizons : 10 + horizons]
        return Peers(
            others, values[0], now_ms=values[6], oldest_ms=values[7], bound=bound, heard_all_ms=heard_all
        )

    async def exchange_runs(self, pool: str, figures: RunFigures) -> dict[str, RunFigures]:
        """One RUNS_POOL call; raises `RedisUnavailable` as `exchange` does."""
        ttl_ms = str(math.ceil(REPLICA_TTL_S * 1000))
        own = (figures.seconds, figures.running, figures.shown, figures.left, figures.idle)
        args = [pool, str(self.calls.replica), ttl_ms, *(repr(max(0.0, float(v))) for v in own)]
        raw = await self.calls.run(
            self.calls.scripts.runs_pool, lambda: args, [], BACKGROUND_TIMEOUT_S, fail_fast=False
        )
        values = [v.decode() if isinstance(v, bytes) else str(v) for v in raw]
        width = 6  # the name and the five figures
        return {
            values[i]: RunFigures(*(float(v) for v in values[i + 1 : i + width]))
            for i in range(0, len(values) - width + 1, width)
        }
