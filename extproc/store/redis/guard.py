"""Noticing that Redis forgot the limiter's state, and refusing a Redis that may forget it.

A Redis restarted without persistence, a `FLUSHALL`, or eviction under `maxmemory` drops the keys that count
open leases. Without a check the replicas then admit a whole new set of requests on top of those still
running (the backend was measured at 16 of 8 slots for 18-38 s). Two defences:

- **Epoch.** The store's keys include `epoch`, a run id every acquire and every guard check refreshes
  (`scripts.epoch`). A replica remembers the id it saw; when the stored id is gone or differs, the
  state it counted in is lost. The script that finds this starts a recovery window in Redis: acquires on
  every replica are refused (`StoreUnavailable`, so the configured fail mode applies) while each replica
  re-adds the leases it holds (a renewal that restores leases missing before their expiry, `leases`) and
  re-sends its scale proposals. Every replica checks the epoch every `guard_interval_s` and each one that
  finds the loss extends the window, so the window ends only after the replicas holding leases have
  re-asserted them.
  Lease keys dropped on their own (eviction with the epoch kept) are found by the next renewal.
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
import math
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Any

from redis.asyncio.cluster import RedisCluster
from redis.exceptions import ResponseError

from extproc.core.ports import EvictionCheck, StoreUnavailable
from extproc.store.redis.breaker import RAW_CLIENT_ERRORS, RedisUnavailable, RedisUnsafe
from extproc.store.redis.calls import BACKGROUND_TIMEOUT_S, Calls
from extproc.store.redis.connection import Client

log = logging.getLogger("extproc.store.redis")

DEFAULT_GUARD_INTERVAL_S = 1.0
"""How often each replica checks the epoch: the longest its leases go uncounted after Redis lost them."""

POLICY_RECHECK_S = 60.0
"""`maxmemory-policy` is read again this often (it can be changed at run time with `CONFIG SET`)."""

SAFE_POLICIES = frozenset({"noeviction"})
"""Policies under which Redis never drops a key to make room (it refuses writes instead)."""


def new_epoch_id() -> str:
    """A run id for the state a fresh (or emptied) Redis starts holding."""
    return secrets.token_hex(8)


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


class StateGuard:
    """This replica's view of the stored state's epoch and of the eviction policy; starts re-assertions."""

    def __init__(self, calls: Calls, guard_interval_s: float) -> None:
        self.calls = calls
        self.guard_interval_s = guard_interval_s
        self.recovery_s = guard_interval_s + BACKGROUND_TIMEOUT_S
        """How long admissions wait after a loss is found: every replica holding leases finds it within one
        guard interval (and extends the wait), then re-asserts them within the background bound."""
        self.epoch = ""  # the run id of the state this replica's leases are counted in ('' not seen yet)
        self.policy = PolicyCheck()
        self.state_losses = 0
        """Times Redis was found to have lost the state (epoch gone, or leases missing before expiry)."""
        self.reassert: Callable[[], Awaitable[None]] = _nothing
        """Re-add this replica's leases and proposals into the new state (set by the store)."""
        self._recovery: asyncio.Task[None] | None = None
        calls.on_epoch = self.on_epoch
        calls.on_reconnect = self.reconnected

    def check_admission(self) -> None:
        """Raise `RedisUnsafe` while Redis may evict limiter keys."""
        if self.policy.state == "evicting":
            raise RedisUnsafe(f"redis maxmemory-policy {self.policy.policy} may evict limiter keys")

    def admission_args(self) -> list[str]:
        """ACQUIRE's epoch arguments: the id this replica knows and the recovery time (ms)."""
        return [self.epoch, str(math.ceil(self.recovery_s * 1000))]

    async def loop(self) -> None:
        while not self.calls.closed:
            await asyncio.sleep(self.guard_interval_s)
            try:
                await self.check()
            except StoreUnavailable:
                pass
            except Exception:
                log.exception("redis store: state check failed")

    async def check(self) -> None:
        """Read the eviction policy when due and compare the stored epoch with the one this replica knows;
        raises `StoreUnavailable` when Redis does not answer."""
        now = time.monotonic()
        if self.policy.needs_check(now):
            try:
                await self.policy.check(self.calls.client, BACKGROUND_TIMEOUT_S, now)
            except RAW_CLIENT_ERRORS as exc:
                raise RedisUnavailable(f"redis: {type(exc).__name__}") from exc
        recovery_ms = str(math.ceil(self.recovery_s * 1000))
        raw = await self.calls.run(
            self.calls.scripts.guard,
            lambda: [self.epoch, new_epoch_id(), recovery_ms],
            (),
            BACKGROUND_TIMEOUT_S,
            fail_fast=False,
        )
        self.on_epoch(str(raw[0]), float(raw[1]))
        if self._recovery is not None:
            await asyncio.shield(self._recovery)

    def reconnected(self) -> None:
        """Redis answers again after failing: it may be another server, with another policy or no state."""
        self.policy.due = True
        self.calls.background.spawn(self.check())

    def on_epoch(self, epoch_id: str, recovery_left_s: float) -> bool:
        """Adopt the first epoch seen; a different one later means Redis lost the state: re-assert (once at
        a time). True while this replica's leases are not yet counted in the stored state."""
        if not self.epoch:
            self.epoch = epoch_id
            return False
        if epoch_id == self.epoch:
            return False
        if self._recovery is None:
            self._recovery = self.calls.background.spawn(self._recover(epoch_id))
        return True

    async def _recover(self, epoch_id: str) -> None:
        """Re-assert into the new state, then adopt its epoch. On failure the old epoch is kept, so the next
        check finds the loss again and retries."""
        self.state_losses += 1
        log.error(
            "redis store: Redis lost the limiter state (flushed, restarted empty or evicted); re-asserting "
            "this replica's leases before admitting again"
        )
        try:
            await self.reassert()
            self.epoch = epoch_id
        except StoreUnavailable:
            log.warning(
                "redis store: leases not re-asserted yet", extra={"error": self.calls.breaker.last_error}
            )
        finally:
            self._recovery = None

    def restored(self, count: int) -> None:
        """A renewal re-added `count` leases Redis had lost; outside a recovery that is a loss of its own."""
        if self._recovery is not None:  # the re-assertion after an epoch change, already logged
            log.info("redis store: leases re-asserted", extra={"restored": count})
            return
        self.state_losses += 1  # found by a renewal under a kept epoch: keys were dropped
        log.error(
            "redis store: leases missing before their expiry (Redis evicted, flushed or restarted empty); "
            "re-added",
            extra={"restored": count},
        )


async def _nothing() -> None:
    return None
