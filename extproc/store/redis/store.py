"""`RedisStore`: the shared `LimiterStore`, composed of the package's parts.

Several gateway replicas enforce one set of global limits through it. Every acquire, release, renewal and
status read is one Lua script call (one round trip, atomic across all of a request's keys, `scripts`), using
Redis server time, so replica clock skew cannot mint tokens. Which key refused and the retry hints come from
the state the script returns, by the in-process `JointLimiter`'s own code (`extproc.core.limiter.state`).

The parts: `connection` (client, TLS, ACL), `calls` (script calls, retries on `stale`/`epoch` replies,
background tasks), `breaker` (failures and fail-fast), `keyspace` (limits, scales, KEYSPEC, state rebuilt
from replies), `views` (the metrics cache), `leases` (acquire, adoption, release, renewal), `forget` (what
a lost answer placed, taken back), `refunds` (parts of a lease given back early), `scales` (the shared
adaptive scale), `wake` (wake-ups across replicas), `mailbox` (messages between replicas), `guard` (a Redis
that lost its state or may evict).

All methods run on one event loop; local state is only touched between awaits. `snapshot()` does no I/O: it
serves a cache refreshed after every call and every `refresh_s` by a background task.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping, Sequence

from extproc.core.limiter.limiter import Lease, Rejection
from extproc.core.limiter.state import KeySnapshot, LimitSpec, RateLimitStatus, tightest_status
from extproc.core.ports import StoreHealth, StoreUnavailable
from extproc.store.redis.breaker import RAW_CLIENT_ERRORS, Breaker
from extproc.store.redis.calls import BACKGROUND_TIMEOUT_S, Background, Calls
from extproc.store.redis.connection import (
    DEFAULT_MAX_CONNECTIONS,
    Client,
    Credentials,
    Mode,
    TlsOptions,
    connect,
)
from extproc.store.redis.guard import DEFAULT_GUARD_INTERVAL_S, StateGuard
from extproc.store.redis.keyspace import Keyspace
from extproc.store.redis.kvboard import RedisKvBoard
from extproc.store.redis.leases import Leases
from extproc.store.redis.mailbox import RedisMailbox
from extproc.store.redis.refunds import refund, release_slot
from extproc.store.redis.scales import Scales
from extproc.store.redis.views import Views
from extproc.store.redis.wake import Wake

log = logging.getLogger("extproc.store.redis")

DEFAULT_LEASE_TTL_S = 60.0
"""How long a lease survives without renewal: the longest a dead replica's slots stay taken."""

DEFAULT_TIMEOUT_S = 0.1
"""Bound on one acquire or release (normally 0.1-0.4 ms); well inside Envoy's 200 ms message timeout."""

DEFAULT_REFRESH_S = 5.0
"""How often the metrics cache is re-read from Redis (it is also updated after every acquire and release)."""


class RedisStore:
    """`LimiterStore` shared by every replica pointing at the same Redis and key prefix."""

    def __init__(
        self,
        client: Client,
        *,
        key_prefix: str = "extproc:",
        lease_ttl_s: float = DEFAULT_LEASE_TTL_S,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        refresh_s: float = DEFAULT_REFRESH_S,
        max_in_flight: int = DEFAULT_MAX_CONNECTIONS,
        guard_interval_s: float = DEFAULT_GUARD_INTERVAL_S,
    ) -> None:
        if lease_ttl_s <= 0 or timeout_s <= 0 or refresh_s <= 0 or guard_interval_s <= 0:
            raise ValueError("lease_ttl_s, timeout_s, refresh_s and guard_interval_s must be > 0")
        self.client = client
        self.key_prefix = key_prefix
        # One hash tag for every key: a script touches keys of several limiter keys, which Redis Cluster only
        # allows within one slot.
        self.base = f"{key_prefix}{{limits}}:"
        self.timeout_s = timeout_s
        self.refresh_s = refresh_s
        self.background = Background()
        self.calls = Calls(client, self.base, max_in_flight, Breaker(), self.background)
        self.keyspace = Keyspace()
        self.views = Views(self.calls, self.keyspace, timeout_s)
        self.guard = StateGuard(self.calls, guard_interval_s)
        self.wake = Wake(self.calls)
        self.scales = Scales(self.calls, self.keyspace, self.views, self.wake)
        self.leases = Leases(
            self.calls, self.keyspace, self.views, self.guard, lease_ttl_s=lease_ttl_s, timeout_s=timeout_s
        )
        self.guard.reassert = self._reassert
        self._tasks: list[asyncio.Task[None]] = []

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        mode: Mode = "standalone",
        tls: TlsOptions | None = None,
        credentials: Credentials | None = None,
        key_prefix: str = "extproc:",
        lease_ttl_s: float = DEFAULT_LEASE_TTL_S,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        refresh_s: float = DEFAULT_REFRESH_S,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        guard_interval_s: float = DEFAULT_GUARD_INTERVAL_S,
    ) -> RedisStore:
        """A store on a `redis://` / `rediss://` / `unix://` URL, one Redis or (`mode="cluster"`) a Redis
        Cluster reached through any of its nodes. The client never retries on its own: a retried acquire
        after a timeout could take capacity twice; retries are this store's decision (`connection`)."""
        client = connect(
            url,
            mode=mode,
            timeout_s=timeout_s,
            socket_timeout_s=max(timeout_s, BACKGROUND_TIMEOUT_S),
            tls=tls,
            credentials=credentials,
            max_connections=max_connections,
        )
        return cls(
            client,
            key_prefix=key_prefix,
            lease_ttl_s=lease_ttl_s,
            timeout_s=timeout_s,
            refresh_s=refresh_s,
            max_in_flight=max_connections,
            guard_interval_s=guard_interval_s,
        )

    # -- lifecycle -----------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Load the scripts, learn the epoch, check the eviction policy and start renewing leases. Redis being
        down now is logged, not fatal: scripts are loaded again on first use (also after a Redis restart
        flushed them), the epoch and the policy on the next guard check."""
        try:
            await self.calls.load()
        except RAW_CLIENT_ERRORS as exc:
            self.calls.breaker.failed(exc)
            log.warning("redis store: cannot load scripts yet", extra={"error": self.last_error})
        with contextlib.suppress(StoreUnavailable):
            await self.check_state()
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self.guard.loop(), name="redis-store-guard"),
            loop.create_task(self.leases.renew_loop(), name="redis-store-renew"),
            loop.create_task(self._refresh_loop(), name="redis-store-refresh"),
            loop.create_task(self.scales.loop(), name="redis-store-scale"),
        ]
        if self.wake.callbacks:
            self._tasks.append(loop.create_task(self.wake.loop(), name="redis-store-wake"))

    async def close(self) -> None:
        """Stop renewing and close the connections. Leases still open expire after the lease TTL. Bounded:
        a task that does not end when cancelled (the pub/sub client can hold on to a cancellation while its
        server is unreachable) is left behind after `BACKGROUND_TIMEOUT_S` rather than hang the shutdown."""
        self.wake.closed = True
        self.calls.closed = True
        tasks = [*self._tasks, *self.background.tasks]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=BACKGROUND_TIMEOUT_S)
        self._tasks.clear()
        self.background.tasks.clear()
        await self.calls.close()

    # -- configuration -------------------------------------------------------------------------------------

    async def apply_limits(
        self,
        specs: Mapping[str, LimitSpec],
        defaults: Mapping[str, LimitSpec] | None = None,
        priority: Sequence[str] = (),
    ) -> None:
        """Install new base limits. Counts in Redis are kept, so open leases stay counted. Best effort (Redis
        down is logged, not raised): the buckets of keys whose limits change are stored at the old
        capacities, then resized to the new ones, in batches, and the metrics cache is refreshed. Each
        script call is built from one config, the old or the new, so no request is judged under a mix; a
        bucket not resized yet is clamped to the new capacity by the script that next reads it."""
        keys = self.keyspace.changed_by(specs, defaults, priority, self.views.entries)
        await self.views.sync(keys, "fill")  # at the capacities in force until now
        self.keyspace.configure(specs, defaults, priority)
        await self.views.sync(keys, "resize")

    async def set_scale(self, key: str, scale: float) -> None:
        await self.scales.set_scale(key, scale)

    def propose_scale(self, key: str, scale: float) -> None:
        self.scales.propose_scale(key, scale)

    def effective_scale(self, key: str) -> float:
        return self.keyspace.effective_scale(key)

    # -- admission -----------------------------------------------------------------------------------------

    async def acquire(
        self,
        keys: Sequence[str],
        tokens: int,
        holder: str | None = None,
        use_pool: bool = True,
        output_tokens: int = 0,
    ) -> Lease | Rejection:
        return await self.leases.acquire(keys, tokens, holder, use_pool, output_tokens)

    async def adopt(self, lease: Lease) -> Lease:  # a lease of the local fallback, counted here from now on
        return await self.leases.adopt(lease)

    async def release(self, lease: Lease, actual_tokens: int, actual_output: int = 0) -> bool:
        return await self.leases.release(lease, actual_tokens, actual_output)

    async def release_slot(self, lease: Lease) -> bool:
        key_ttl_ms = self.leases.key_ttl_ms()
        return await release_slot(self.calls, self.keyspace, self.views, lease, self.timeout_s, key_ttl_ms)

    async def refund(self, lease: Lease, tokens: int) -> bool:
        return await refund(self.calls, self.keyspace, lease, tokens, self.timeout_s)

    async def status(self, keys: Sequence[str], holder: str | None = None) -> RateLimitStatus:
        """The tightest remaining capacity over `keys` (one script call; raises `StoreUnavailable`)."""
        unique = tuple(dict.fromkeys(keys))
        if not unique:
            return RateLimitStatus()
        views, now = await self.views.read(list(unique), "0", background=False)
        return tightest_status(unique, views, holder, now)

    def snapshot(self) -> list[KeySnapshot]:
        """Every key seen lately, as of its last read from Redis (no I/O: called at metrics scrape time)."""
        return self.views.snapshot()

    def prune(self) -> int:
        """Nothing to forget here: every key in Redis carries a TTL and expires when idle."""
        return 0

    def mailbox(self, own: str) -> RedisMailbox:  # by pub/sub on this Redis and key prefix
        return RedisMailbox(self.client, self.key_prefix, own)

    def kv_board(self) -> RedisKvBoard:  # the pools' KV figures of every replica on this Redis
        return RedisKvBoard(self.calls)

    # -- background work -----------------------------------------------------------------------------------

    async def renew(self) -> int:
        """Renew every open lease now (see `Leases.renew`); returns the number renewed."""
        return await self.leases.renew()

    async def refresh(self) -> None:
        await self.views.refresh()

    async def check_state(self) -> None:
        """The guard's check now: eviction policy when due, and the epoch (see `guard`)."""
        await self.guard.check()

    async def _reassert(self) -> None:
        """Redis lost the state: add this replica's open leases and scale proposals back."""
        await self.leases.renew()
        await self.scales.repropose()

    async def _refresh_loop(self) -> None:
        while not self.calls.closed:
            await asyncio.sleep(self.refresh_s)
            try:
                await self.refresh()
            except StoreUnavailable:
                pass
            except Exception:
                log.exception("redis store: metrics cache refresh failed")

    # -- waking waiters across replicas --------------------------------------------------------------------

    def on_wake(self, callback: Callable[[], None]) -> None:
        """Call `callback` whenever capacity may have freed on another replica (a release, a scale raised).

        Callbacks run on the event loop and must not block. They are also called after the subscription
        (re)connects, since messages sent while it was down are lost.
        """
        self.wake.callbacks.append(callback)
        if self._tasks and not any(t.get_name() == "redis-store-wake" for t in self._tasks):
            self._tasks.append(
                asyncio.get_running_loop().create_task(self.wake.loop(), name="redis-store-wake")
            )

    def announce_waiting(self) -> None:
        self.wake.announce_waiting()

    # -- observation ---------------------------------------------------------------------------------------

    @property
    def available(self) -> bool:
        """False while calls fail fast after repeated failures, or while Redis may evict limiter keys (for
        readiness or a fallback decision)."""
        return self.calls.breaker.closed and self.guard.policy.state != "evicting"

    def health(self) -> StoreHealth:
        return StoreHealth(
            available=self.available,
            lost_leases=self.lost_leases,
            dropped_releases=self.dropped_releases,
            state_losses=self.guard.state_losses,
            restored_leases=self.leases.restored_leases,
            eviction=self.guard.policy.state,
        )

    @property
    def lost_leases(self) -> int:
        """Leases found expired at renewal (Redis was unreachable for longer than the lease TTL)."""
        return self.leases.lost_leases

    @property
    def dropped_releases(self) -> int:
        """Releases given up after their retries, left to lease expiry."""
        return self.leases.dropped_releases

    @property
    def wakeups(self) -> int:
        """Wake-up messages received from releases (on any replica)."""
        return self.wake.wakeups

    @property
    def stale_retries(self) -> int:
        """Calls sent again because the effective scale had changed."""
        return self.calls.stale_retries

    @property
    def server_time(self) -> float:
        """Redis server time of the last state read (what the last decision was judged at)."""
        return self.views.server_time

    @property
    def last_error(self) -> str | None:
        return self.calls.breaker.last_error

    @property
    def lease_ttl_s(self) -> float:
        return self.leases.lease_ttl_s

    @property
    def guard_interval_s(self) -> float:
        return self.guard.guard_interval_s

    @property
    def recovery_s(self) -> float:
        """How long admissions wait after a loss is found (see `guard`)."""
        return self.guard.recovery_s
