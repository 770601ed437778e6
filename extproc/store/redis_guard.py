"""Noticing that Redis forgot the limiter's state, and refusing a Redis that may forget it.

A Redis restarted without persistence, a `FLUSHALL`, or eviction under `maxmemory` drops the keys that count
open leases. Without a check the replicas then admit a whole new set of requests on top of those still
running (the backend was measured at 16 of 8 slots for 18-38 s). Two defences:

- **Epoch.** The store's keys include `epoch`, a run id every acquire and every guard check refreshes
  (`redis_scripts.epoch`). A replica remembers the id it saw; when the stored id is gone or differs, the
  state it counted in is lost. The script that finds this starts a recovery window in Redis: acquires on
  every replica are refused (`StoreUnavailable`, so the configured fail mode applies) while each replica
  re-adds the leases it holds (a renewal that restores leases missing before their expiry) and re-sends its
  scale proposals. Every replica checks the epoch every `guard_interval_s` and each one that finds the loss
  extends the window, so the window ends only after the replicas holding leases have re-asserted them.
  A replica that never knew an epoch (just started) cannot tell a fresh Redis from a flushed one: it starts
  no window; a replica that knew the old one starts it within one guard interval.
- **Eviction policy.** At start, after Redis failed and answered again, and every `POLICY_RECHECK_S`, the
  store reads `maxmemory-policy` (on every node of a Cluster). Any policy but `noeviction` lets Redis evict
  limiter keys (they all carry TTLs, so `volatile-*` policies pick them first): the store then refuses
  acquires, as if Redis were down, until the policy is fixed. `CONFIG GET` may be refused (an ACL user
  without `+config`, a managed Redis that renames or disables `CONFIG`): the verdict is then `unverified`,
  logged once at warning level and exported, and the store runs, relying on the epoch to notice a loss.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from dataclasses import dataclass
from typing import Any

from redis.asyncio.cluster import RedisCluster
from redis.exceptions import ResponseError

from extproc.core.ports import EvictionCheck
from extproc.store.redis_connect import Client

log = logging.getLogger(__name__)

DEFAULT_GUARD_INTERVAL_S = 1.0
"""How often each replica checks the epoch: the longest its leases go uncounted after Redis lost them."""

POLICY_RECHECK_S = 60.0
"""`maxmemory-policy` is read again this often (it can be changed at run time with `CONFIG SET`)."""

SAFE_POLICIES = frozenset({"noeviction"})
"""Policies under which Redis never drops a key to make room (it refuses writes instead)."""


def new_epoch_id() -> str:
    """A run id for the state a fresh (or emptied) Redis starts holding."""
    return secrets.token_hex(8)


@dataclass(frozen=True)
class Epoch:
    """A GUARD or ACQUIRE reply about the stored run id: the id and the recovery time left (s)."""

    id: str
    recovery_left_s: float


async def read_policies(client: Client, timeout_s: float) -> list[str]:
    """`maxmemory-policy` of the one Redis, or of every node of a Cluster (any of them may become the
    primary of the store's slot). Raises `ResponseError` when `CONFIG GET` is refused."""
    async with asyncio.timeout(timeout_s):
        if isinstance(client, RedisCluster):
            raw: Any = await client.config_get("maxmemory-policy", target_nodes=RedisCluster.ALL_NODES)
        else:
            raw = await client.config_get("maxmemory-policy")
    replies = list(raw.values()) if isinstance(client, RedisCluster) and _per_node(raw) else [raw]
    return [str(reply.get("maxmemory-policy", "")) for reply in replies]


def _per_node(raw: Any) -> bool:
    return isinstance(raw, dict) and all(isinstance(v, dict) for v in raw.values()) and bool(raw)


def verdict(policies: list[str]) -> tuple[EvictionCheck, str]:
    """`safe` when every node refuses writes rather than evicting; else `evicting` and the bad policy."""
    bad = sorted({p for p in policies if p not in SAFE_POLICIES})
    if bad:
        return "evicting", ",".join(bad)
    return "safe", policies[0] if policies else ""


class PolicyCheck:
    """The last eviction verdict, re-read when due; logs each change of verdict once."""

    def __init__(self) -> None:
        self.state: EvictionCheck = "safe"
        self.policy = ""
        self.due = True
        self._checked_at: float | None = None

    def needs_check(self, now: float) -> bool:
        """Due after a failure (Redis may have been replaced), while refusing (so a fix is seen within one
        guard interval) and every `POLICY_RECHECK_S`."""
        if self.due or self.state == "evicting" or self._checked_at is None:
            return True
        return now - self._checked_at >= POLICY_RECHECK_S

    async def check(self, client: Client, timeout_s: float, now: float) -> None:
        """Read the policy; connection failures leave the verdict as it was (checked again when due)."""
        try:
            policies = await read_policies(client, timeout_s)
        except ResponseError as exc:
            self._settle("unverified", f"CONFIG GET refused: {exc}", now)
            return
        state, policy = verdict(policies)
        self._settle(state, policy, now)

    def _settle(self, state: EvictionCheck, policy: str, now: float) -> None:
        self.due = False
        self._checked_at = now
        if state != self.state or policy != self.policy:
            if state == "evicting":
                log.error(
                    "redis store: maxmemory-policy lets Redis evict limiter keys; refusing to admit through "
                    "it until it is noeviction",
                    extra={"maxmemory_policy": policy},
                )
            elif state == "unverified":
                log.warning(
                    "redis store: cannot read maxmemory-policy; make sure it is noeviction",
                    extra={"error": policy},
                )
            elif self.state != "safe":
                log.info("redis store: maxmemory-policy is safe again", extra={"maxmemory_policy": policy})
        self.state, self.policy = state, policy
