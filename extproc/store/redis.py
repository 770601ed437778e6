"""A shared `LimiterStore` in Redis: several gateway replicas enforce one set of global limits.

Each replica reads the same config, so each computes the same effective shares (slots and token capacity per
class guarantee and for the burstable pool) with `effective_shares`; only the counts live in Redis, and the
adaptive scale: every replica proposes a scale from its own KV feed, Redis keeps one effective scale per key
(the minimum of the fresh proposals), and every script refuses capacities computed at another scale (the
caller adopts the stored one and calls again). So all replicas admit at one scale at every decision. Every
acquire, release, renewal and status read is one Lua script call (one round trip, atomic across all of a
request's keys), using Redis server time, so replica clock skew cannot mint tokens. Which key refused and the
retry hints are then derived in Python from the state the script returns, with the very code the in-process
`JointLimiter` uses, so both stores answer alike.

Leases are members of per-(key, share) sorted sets scored by their expiry. The owning replica renews its open
leases every `lease_ttl_s / 3`; a replica that dies stops renewing and its leases drop out of every count
`lease_ttl_s` later. A lease that outlived its TTL without renewal (Redis unreachable for longer than the TTL)
is gone for good: renewing or settling it later is a no-op, never a revival.

Releases wake waiters across replicas: while any replica has requests queued, a release publishes on
`<prefix>{limits}:wake`, and every replica subscribed there pumps its queue at once instead of on its next
100 ms tick. The subscription reconnects on its own after Redis restarts or fails over.

Failures never hang a request: every call is bounded by `timeout_s` and raises `StoreUnavailable`. After
`BREAKER_FAILURES` consecutive failures calls fail fast for `BREAKER_OPEN_S`, then probe again. A release
that fails is retried in the background (bounded) and otherwise left to lease expiry.

Concurrency model: all methods run on one event loop; local state (config, open leases, the metrics cache)
is only touched between awaits. `snapshot()` does no I/O: it serves a cache refreshed after every call and
every `refresh_s` by a background task.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from redis.asyncio.cluster import RedisCluster
from redis.commands.core import AsyncScript
from redis.exceptions import (
    ClusterDownError,
    ReadOnlyError,
    RedisClusterException,
    RedisError,
    ResponseError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError

# The store reuses the limiter's per-key arithmetic (share split, pool accounting, retry hints, status) on the
# state read from Redis, so that the two stores cannot drift apart. These are private to the core on purpose.
from extproc.core.bucket import TokenBucket
from extproc.core.limiter import (
    DEFAULT_HOLD_S,
    SHRUNK_RETRY_S,
    JointLimiter,
    KeySnapshot,
    Lease,
    LimitSpec,
    Placement,
    RateLimitStatus,
    Reason,
    Rejection,
    _KeyState,
    _Share,
)
from extproc.core.ports import StoreHealth, StoreUnavailable
from extproc.core.shares import SHARED
from extproc.store import redis_scripts
from extproc.store.redis_connect import (
    DEFAULT_MAX_CONNECTIONS,
    Client,
    Credentials,
    Mode,
    TlsOptions,
    connect,
)

log = logging.getLogger(__name__)

DEFAULT_LEASE_TTL_S = 60.0
"""How long a lease survives without renewal: the longest a dead replica's slots stay taken."""

DEFAULT_TIMEOUT_S = 0.1
"""Bound on one acquire or release (normally 0.1-0.4 ms); well inside Envoy's 200 ms message timeout."""

DEFAULT_REFRESH_S = 5.0
"""How often the metrics cache is re-read from Redis (it is also updated after every acquire and release)."""

BACKGROUND_TIMEOUT_S = 1.0
"""Bound on renewals, cache refreshes and release retries: off the request path, so they may wait longer."""

LEASE_KEY_MARGIN_S = 10.0
"""Lease sets outlive their newest member by this much, then Redis drops the key."""

RELEASE_RETRY_DELAYS_S = (0.1, 0.5, 1.0, 2.0, 4.0, 8.0)
"""Backoff of a failed release; after the last one the lease is left to expire."""

MAX_PENDING_RETRIES = 10_000
"""Bound on releases waiting for Redis; beyond it they are left to lease expiry."""

BREAKER_FAILURES = 3
BREAKER_OPEN_S = 0.5
"""After this many consecutive failures, calls fail fast for this long instead of each waiting `timeout_s`."""

SCALE_PROPOSAL_TTL_S = 15.0
SCALE_REFRESH_S = 5.0
"""A replica re-sends its scale proposals this often; a proposal not re-sent (a dead replica's) stops
counting after the TTL. Until then a dead replica can only keep limits lower, never higher."""

STALE_RETRIES = 3
"""Calls refused because the effective scale changed meanwhile are sent again this often (each refusal
brings the new scale, so one retry normally suffices)."""

WAITING_ANNOUNCE_S = 2.0
WAITING_REFRESH_S = 0.5
"""A replica with queued requests announces it for this long, refreshed this often while they wait."""

WAKE_BACKOFF_S = (0.1, 2.0)
"""Reconnect delays of the wake-up subscription: first and largest."""

CACHE_IDLE_S = 300.0
CACHE_MAX_KEYS = 4096
"""Unconfigured keys (tenants) leave the metrics cache after this long unseen; the cache stays this small."""


CLIENT_ERRORS = (RedisError, OSError, TimeoutError)
"""What a failing Redis surfaces as."""

RAW_CLIENT_ERRORS = (*CLIENT_ERRORS, AttributeError)
"""Around direct uses of the client. AttributeError: redis-py 8.1.0's connection can lose its stream writer to
a concurrent disconnect (`'NoneType' object has no attribute 'writelines'` in `redis/asyncio/connection.py`
`send_packed_command`), seen when a Cluster primary is killed under load. Script calls go through `_call`,
which turns it into a ConnectionError, so that our own AttributeErrors elsewhere are not taken for one."""

TRANSIENT_REFUSALS = (ClusterDownError, TryAgainError, ReadOnlyError)
"""Replies that a failover produces: unavailability, not a script or a proxy refusing scripts."""


class RedisUnavailable(StoreUnavailable):
    """Redis did not answer within the timeout (down, unreachable, paused, or refusing scripts).

    Raised by `acquire` and `status` as the port's `StoreUnavailable`; the admission path decides what a
    request gets then (fail closed with a 503, or a local fallback). Nothing was admitted: a lease the script
    may still have granted is removed in the background, or expires after the lease TTL.
    """


@dataclass
class _Open:
    """A lease this replica holds: what to renew."""

    lease: Lease
    member: str


@dataclass
class _Cached:
    view: _KeyState  # the key as last read from Redis; turned into a KeySnapshot only at scrape time
    seen_at: float


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
    ) -> None:
        if lease_ttl_s <= 0 or timeout_s <= 0 or refresh_s <= 0:
            raise ValueError("lease_ttl_s, timeout_s and refresh_s must be > 0")
        self.client = client
        # One hash tag for every key: a script touches keys of several limiter keys, which Redis Cluster only
        # allows within one slot.
        self.base = f"{key_prefix}{{limits}}:"
        self.lease_ttl_s = lease_ttl_s
        self.renew_interval_s = lease_ttl_s / 3
        self.timeout_s = timeout_s
        self.refresh_s = refresh_s
        self._acquire = client.register_script(redis_scripts.ACQUIRE)
        self._release = client.register_script(redis_scripts.RELEASE)
        self._peek = client.register_script(redis_scripts.PEEK)
        self._renew = client.register_script(redis_scripts.RENEW)
        self._forget = client.register_script(redis_scripts.FORGET)
        self._refund = client.register_script(redis_scripts.REFUND)
        self._scale = client.register_script(redis_scripts.SCALE)
        self._waiting = client.register_script(redis_scripts.WAITING)
        self._scripts = (
            self._acquire,
            self._release,
            self._peek,
            self._renew,
            self._forget,
            self._refund,
            self._scale,
            self._waiting,
        )
        self._slots = asyncio.Semaphore(max_in_flight)
        self._specs: dict[str, LimitSpec] = {}
        self._defaults: dict[str, LimitSpec] = {}
        self._priority: tuple[str, ...] = ()
        self._configured = False
        self._blocks: dict[str, list[str]] = {}
        self._scales: dict[str, float] = {}  # the effective scale of each key, as last stored in Redis
        self._proposed: dict[str, float] = {}  # this replica's own proposals, re-sent every SCALE_REFRESH_S
        self._wake_callbacks: list[Callable[[], None]] = []
        self._announced_until = 0.0
        self._topology_task: asyncio.Task[None] | None = None
        self._closed = False
        self._calc = JointLimiter(clock=time.monotonic)  # only its `_status` arithmetic is used
        self._replica = secrets.randbits(30)
        self._ids = itertools.count(1)
        self._open: dict[int, _Open] = {}
        self._cache: dict[str, _Cached] = {}
        self._background: set[asyncio.Task[Any]] = set()
        self._tasks: list[asyncio.Task[None]] = []
        self._failures = 0
        self._fail_fast_until = 0.0
        self.last_error: str | None = None
        self.lost_leases = 0
        """Leases found expired at renewal (Redis was unreachable for longer than the lease TTL)."""
        self.dropped_releases = 0
        """Releases given up after their retries, left to lease expiry."""
        self.wakeups = 0
        """Wake-up messages received from releases (on any replica)."""
        self.stale_retries = 0
        """Calls sent again because the effective scale had changed."""
        self.server_time = 0.0
        self.judged: list[float] = []
        """Redis server time of the last state read (what the last decision was judged at)."""

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
    ) -> RedisStore:
        """A store on a `redis://` / `rediss://` / `unix://` URL, one Redis or (`mode="cluster"`) a Redis
        Cluster reached through any of its nodes. The client never retries on its own: a retried acquire
        after a timeout could take capacity twice; retries are this store's decision (`redis_connect`)."""
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
        )

    # -- lifecycle -----------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Load the scripts and start renewing leases. Redis being down now is logged, not fatal: scripts
        are loaded again on first use (also after a Redis restart flushed them)."""
        try:
            async with asyncio.timeout(BACKGROUND_TIMEOUT_S):
                for script in self._scripts:
                    script.sha = await self.client.script_load(script.script)
        except RAW_CLIENT_ERRORS as exc:
            self._failed(exc)
            log.warning("redis store: cannot load scripts yet", extra={"error": self.last_error})
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._renew_loop(), name="redis-store-renew"),
            loop.create_task(self._refresh_loop(), name="redis-store-refresh"),
            loop.create_task(self._scale_loop(), name="redis-store-scale"),
        ]
        if self._wake_callbacks:
            self._tasks.append(loop.create_task(self._wake_loop(), name="redis-store-wake"))

    async def close(self) -> None:
        """Stop renewing and close the connections. Leases still open expire after the lease TTL.

        Bounded: a task that does not end when cancelled (the pub/sub client can hold on to a cancellation
        while its server is unreachable) is left behind after `BACKGROUND_TIMEOUT_S` rather than hanging
        the sidecar's shutdown.
        """
        self._closed = True
        tasks = [*self._tasks, *self._background]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=BACKGROUND_TIMEOUT_S)
        self._tasks.clear()
        self._background.clear()
        with contextlib.suppress(*RAW_CLIENT_ERRORS):
            async with asyncio.timeout(BACKGROUND_TIMEOUT_S):
                await self.client.aclose()

    @property
    def available(self) -> bool:
        """False while calls fail fast after repeated failures (for readiness or a fallback decision)."""
        return time.monotonic() >= self._fail_fast_until

    @property
    def open_leases(self) -> int:
        return len(self._open)

    # -- configuration -------------------------------------------------------------------------------------

    async def apply_limits(
        self,
        specs: Mapping[str, LimitSpec],
        defaults: Mapping[str, LimitSpec] | None = None,
        priority: Sequence[str] = (),
    ) -> None:
        """Install new base limits. Counts in Redis are kept, so open leases stay counted. Best effort (Redis
        down is logged, not raised): buckets are stored at the old capacities, then resized to the new ones,
        and the metrics cache is refreshed."""
        keys = list(dict.fromkeys([*self._specs, *specs, *self._cache]))
        await self._sync(keys, "fill")  # at the capacities in force until now
        self._specs = dict(specs)
        self._defaults = dict(defaults or {})
        self._priority = tuple(priority)
        self._configured = True
        self._blocks.clear()
        await self._sync(keys, "resize")

    async def set_scale(self, key: str, scale: float) -> None:
        """Propose this replica's scale for a key (from its KV feed); 1 withdraws the proposal.

        The scale every replica then admits at is the stored effective one, the minimum of the fresh
        proposals. Best effort like `apply_limits`: Redis down is logged; the proposal is re-sent every
        `SCALE_REFRESH_S` anyway.
        """
        if not 0 < scale <= 1:
            raise ValueError("scale must be in (0, 1]")
        if self._proposed.get(key) == scale:
            return
        self._proposed[key] = scale
        try:
            await self._propose(key, scale)
        except StoreUnavailable:
            log.warning("redis store: scale proposal not stored yet", extra={"key": key})

    def propose_scale(self, key: str, scale: float) -> None:
        """`set_scale` from synchronous code: the proposal is sent in the background, then local waiters are
        woken (a raised scale may admit them)."""
        self._spawn(self._propose_and_wake(key, scale))

    async def _propose_and_wake(self, key: str, scale: float) -> None:
        await self.set_scale(key, scale)
        for callback in self._wake_callbacks:
            callback()

    def prune(self) -> int:
        """Nothing to forget here: every key in Redis carries a TTL and expires when idle."""
        return 0

    def health(self) -> StoreHealth:
        return StoreHealth(
            available=self.available, lost_leases=self.lost_leases, dropped_releases=self.dropped_releases
        )

    async def _propose(self, key: str, scale: float) -> None:
        """One SCALE call; when the effective scale changed, resize the key's buckets to it (the script
        stored them at the old capacities first), as the in-process limiter does on a scale change."""
        ttl_ms = str(math.ceil(SCALE_PROPOSAL_TTL_S * 1000))
        raw = await self._run(
            self._scale,
            lambda: [str(self._replica), repr(scale), ttl_ms, *self._keyspec([key])],
            [key],
            BACKGROUND_TIMEOUT_S,
            fail_fast=False,
        )
        before, after = float(raw[0]), float(raw[1])
        self._adopt_scales([key], [after])
        if after != before:
            await self._sync([key], "resize")
            if after > before:
                self._notify()

    def _adopt_scales(self, keys: Sequence[str], scales: Sequence[float]) -> None:
        for key, scale in zip(keys, scales, strict=True):
            if self._scales.get(key, 1.0) != scale:
                if scale == 1.0:
                    self._scales.pop(key, None)
                else:
                    self._scales[key] = scale
                self._blocks.pop(key, None)

    def effective_scale(self, key: str) -> float:
        """The key's scale as last stored in Redis (what this replica's last call on it was judged at)."""
        return self._scales.get(key, 1.0)

    async def _sync(self, keys: list[str], mode: str) -> None:
        if not keys or (mode == "fill" and not self._configured):
            return  # a replica that has no config yet knows no capacities to fill at
        try:
            await self._peek_keys(keys, mode, background=True)
        except StoreUnavailable:
            log.warning(
                "redis store: limits applied locally, Redis not updated yet", extra={"keys": len(keys)}
            )

    def _spec(self, key: str) -> tuple[LimitSpec, bool]:
        spec = self._specs.get(key)
        if spec is not None:
            return spec, True
        for prefix, default in self._defaults.items():
            if key.startswith(prefix):
                return default, False
        return LimitSpec(), False

    def _template(self, key: str) -> _KeyState:
        """The key's configured shares with their effective capacities, nothing counted yet."""
        spec, configured = self._spec(key)
        state = _KeyState(
            spec=spec, priority=self._priority, scale=self._scales.get(key, 1.0), configured=configured
        )
        state.rebuild(0.0)
        return state

    def _keyspec(self, keys: Sequence[str]) -> list[str]:
        """The KEYSPEC argument block of the scripts (see `redis_scripts`)."""
        out = [str(len(keys))]
        for key in keys:
            block = self._blocks.get(key)
            if block is None:
                block = self._block(key)
                if len(self._blocks) >= CACHE_MAX_KEYS:
                    self._blocks.clear()
                self._blocks[key] = block
            out += block
        return out

    def _block(self, key: str) -> list[str]:
        """One key's part of KEYSPEC; cached until the limits or the key's scale change."""
        state = self._template(key)
        out = [key, repr(state.scale), "1" if state.spec.tokens_per_minute is not None else "0"]
        out.append(str(len(state.shares)))
        for name, share in state.shares.items():
            out += [
                name,
                _num(share.concurrency),
                _num(share.tokens_per_minute),
                repr(state._base_tokens(name)),
            ]
        return out

    # -- admission -----------------------------------------------------------------------------------------

    async def acquire(
        self, keys: Sequence[str], tokens: int, holder: str | None = None, use_pool: bool = True
    ) -> Lease | Rejection:
        """Take one slot and `tokens` on every key, all or nothing, in one script call.

        Raises `StoreUnavailable` when Redis does not answer within `timeout_s`.
        """
        if tokens < 0:
            raise ValueError("tokens must be >= 0")
        unique = tuple(dict.fromkeys(keys))
        lease_id = (self._replica << 32) | next(self._ids)
        member = str(lease_id)
        if not unique:
            status = RateLimitStatus()
            return Lease(lease_id, unique, tokens, time.monotonic(), status, holder)
        head = [
            member,
            repr(self.lease_ttl_s),
            str(self._lease_key_ttl_ms()),
            str(tokens),
            holder or "",
            "1" if use_pool else "0",
            repr(SHRUNK_RETRY_S if use_pool else DEFAULT_HOLD_S),
        ]
        try:
            raw = await self._run(
                self._acquire, lambda: [*head, *self._keyspec(unique)], unique, self.timeout_s
            )
        except (StoreUnavailable, asyncio.CancelledError):
            # The script may have run before the answer was lost: take back any slot it placed.
            self._spawn(self._forget_lease(member, unique, holder))
            raise
        code, index, now = int(raw[0]), int(raw[1]), float(raw[2])
        places, views = self._parse_states(unique, raw[3:], now, self.judged, with_places=True)
        self._remember(unique, views, now)
        if code:
            key = unique[index - 1]
            view = views[index - 1]
            status = self._calc._status(unique, views, holder, now)
            if code == 1:
                return Rejection(Reason.CONCURRENCY, key, view.slot_retry_after(holder), status)
            if code == 3:
                return Rejection(Reason.TOO_LARGE, key, None, status)
            # A refused request took nothing: the returned state is the one it was judged on.
            _, retry = view.place_tokens(holder, tokens, now, use_pool)
            return Rejection(Reason.TOKENS, key, retry, status)
        placements = tuple(
            Placement(key, slot, tok or None) for key, (slot, tok) in zip(unique, places, strict=True)
        )
        lease = Lease(
            lease_id=lease_id,
            keys=unique,
            reserved_tokens=tokens,
            acquired_at=now,
            status=self._calc._status(unique, views, holder, now),
            holder=holder,
            placements=placements,
        )
        self._open[lease_id] = _Open(lease, member)
        return lease

    async def release(self, lease: Lease, actual_tokens: int) -> bool:
        """Settle a lease to the tokens really used, in one script call.

        False when it was settled before (by this process, or found already removed or expired in Redis).
        If Redis cannot be reached the settlement is retried in the background and True is returned: this
        call did settle the lease as far as the caller is concerned, and the slot comes back at the latest
        when the lease expires.
        """
        if lease.settled:
            return False
        lease.settled = True
        lease.actual_tokens = max(0, actual_tokens)
        self._open.pop(lease.lease_id, None)
        if not lease.placements:
            return True
        head = [
            str(lease.lease_id),
            str(lease.reserved_tokens),
            str(lease.actual_tokens),
            repr(lease.acquired_at),
        ]
        tail: list[str] = []
        for placement in lease.placements:
            tail += [placement.slot, placement.tokens or ""]

        def args() -> list[str]:
            return [*head, *self._keyspec(lease.keys), *tail]

        try:
            raw = await self._run(self._release, args, lease.keys, self.timeout_s)
        except (StoreUnavailable, asyncio.CancelledError):
            self._retry_release(args, lease.keys)
            return True
        now = float(raw[1])
        _, views = self._parse_states(lease.keys, raw[2:], now, self.judged, with_places=False)
        self._remember(lease.keys, views, now)
        return bool(int(raw[0]))

    async def refund(self, lease: Lease, tokens: int) -> bool:
        """Give `tokens` of an open lease's reservation back to its buckets now, in one script call.

        False when the lease is settled, or found removed or expired in Redis. When Redis does not answer
        the refund may or may not have run: the lease is then taken as refunded (its release refunds that
        much less), so a lost reply can under-refund a bucket until it refills, never refund it twice.
        """
        tokens = max(0, min(tokens, lease.reserved_tokens))
        if lease.settled or not lease.placements or tokens == 0:
            return False
        head = [str(lease.lease_id), str(tokens)]
        tail: list[str] = []
        for placement in lease.placements:
            tail += [placement.slot, placement.tokens or ""]
        try:
            raw = await self._run(
                self._refund, lambda: [*head, *self._keyspec(lease.keys), *tail], lease.keys, self.timeout_s
            )
        except StoreUnavailable:
            lease.reserved_tokens -= tokens
            return False
        if not int(raw[0]):
            return False
        lease.reserved_tokens -= tokens
        return True

    async def status(self, keys: Sequence[str], holder: str | None = None) -> RateLimitStatus:
        """The tightest remaining capacity over `keys` (one script call; raises `StoreUnavailable`)."""
        unique = tuple(dict.fromkeys(keys))
        if not unique:
            return RateLimitStatus()
        views, now = await self._peek_keys(list(unique), "0", background=False)
        return self._calc._status(unique, views, holder, now)

    def snapshot(self) -> list[KeySnapshot]:
        """Every key seen lately, as of its last read from Redis (no I/O: called at metrics scrape time)."""
        return [entry.view.snapshot(key) for key, entry in self._cache.items()]

    # -- Redis calls ---------------------------------------------------------------------------------------

    async def _run(
        self,
        script: AsyncScript,
        args: Callable[[], list[str]],
        keys: Sequence[str],
        limit_s: float,
        fail_fast: bool = True,
    ) -> Any:
        """A script call whose KEYSPEC (built by `args`) must match the stored scales: on a `stale` reply the
        stored scales are adopted and the call is sent again, all within `limit_s`.

        `self.judged` is set to the scales of `keys` in the call that was answered (what the script judged
        at), for the caller to rebuild its views with before anything else runs on the loop.
        """
        if fail_fast and time.monotonic() < self._fail_fast_until:
            raise RedisUnavailable(f"redis unavailable (failing fast): {self.last_error}")
        try:
            async with asyncio.timeout(limit_s):
                for _ in range(STALE_RETRIES + 1):
                    sent = [self._scales.get(k, 1.0) for k in keys]
                    raw = await self._call(script, args())
                    if not isinstance(raw, list) or not raw or raw[0] != "stale":
                        break
                    self.stale_retries += 1
                    self._adopt_scales(keys, [float(v) for v in raw[1:]])
                else:
                    raise RedisUnavailable("redis: the effective scale kept changing")
        except CLIENT_ERRORS as exc:
            self._failed(exc)
            self._refresh_topology()
            raise RedisUnavailable(f"redis: {self.last_error}") from exc
        self._failures = 0
        self._fail_fast_until = 0.0
        self.judged = sent
        return raw

    def _refresh_topology(self) -> None:
        """Cluster only: look up the slot owners again in the background, with the background bound.

        After a failover the client must learn the new primary (`RedisCluster.initialize`). Done inside a
        request, that lookup shares the request's `timeout_s` and is cancelled before it completes whenever
        a node is slow to refuse; in the background it has `BACKGROUND_TIMEOUT_S`, and requests that wait
        on the client's initialization lock then find the new layout.
        """
        if not isinstance(self.client, RedisCluster) or self._topology_task is not None:
            return

        async def refresh() -> None:
            try:
                async with asyncio.timeout(BACKGROUND_TIMEOUT_S):
                    await self.client.initialize()
            except (*RAW_CLIENT_ERRORS, RedisClusterException) as exc:
                log.info("redis store: cluster layout not refreshed yet", extra={"error": type(exc).__name__})
            finally:
                self._topology_task = None

        self._topology_task = asyncio.get_running_loop().create_task(refresh())
        self._background.add(self._topology_task)
        self._topology_task.add_done_callback(self._background.discard)

    async def _call(self, script: AsyncScript, args: list[str]) -> Any:
        async with self._slots:
            try:
                return await script(keys=[self.base], args=args)
            except AttributeError as exc:  # see RAW_CLIENT_ERRORS
                raise RedisConnectionError(f"connection lost: {exc}") from exc

    def _failed(self, exc: BaseException) -> None:
        self.last_error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        self._failures += 1
        if self._failures >= BREAKER_FAILURES:
            self._fail_fast_until = time.monotonic() + BREAKER_OPEN_S
        if isinstance(exc, ResponseError) and not isinstance(exc, TRANSIENT_REFUSALS):
            # a script error or a proxy refusing scripts: never silent
            log.error("redis store: command refused", extra={"error": self.last_error})

    async def _peek_keys(self, keys: list[str], mode: str, background: bool) -> tuple[list[_KeyState], float]:
        """One PEEK call (mode "0", "fill" or "resize", see `redis_scripts.PEEK`); updates the cache."""
        timeout = BACKGROUND_TIMEOUT_S if background else self.timeout_s
        raw = await self._run(
            self._peek, lambda: [mode, *self._keyspec(keys)], keys, timeout, fail_fast=not background
        )
        now = float(raw[0])
        _, views = self._parse_states(keys, raw[1:], now, self.judged, with_places=False)
        self._remember(keys, views, now)
        return views, now

    def _parse_states(
        self, keys: Sequence[str], raw: list[Any], now: float, scales: Sequence[float], with_places: bool
    ) -> tuple[list[tuple[str, str]], list[_KeyState]]:
        """Rebuild each key's state as the limiter would hold it, from a script's reply."""
        places: list[tuple[str, str]] = []
        views: list[_KeyState] = []
        i = 0
        for key, scale in zip(keys, scales, strict=True):
            if with_places:
                places.append((str(raw[i]), str(raw[i + 1])))
                i += 2
            hold = float(raw[i]) if raw[i] != "" else None
            count = int(raw[i + 1])
            i += 2
            shares: list[tuple[str, int, float | None]] = []
            for _ in range(count):
                shares.append((str(raw[i]), int(raw[i + 1]), float(raw[i + 2]) if raw[i + 2] != "" else None))
                i += 3
            views.append(self._view(key, shares, hold, now, scale))
        return places, views

    def _view(
        self,
        key: str,
        shares: list[tuple[str, int, float | None]],
        hold: float | None,
        now: float,
        scale: float,
    ) -> _KeyState:
        spec, configured = self._spec(key)
        state = _KeyState(spec=spec, priority=self._priority, scale=scale, configured=configured)
        for name, active, _ in shares:
            state.shares[name] = _Share(active=active)
        state.rebuild(now)
        for name, _, tokens in shares:
            share = state.shares.get(name)
            if share is None or tokens is None:
                continue
            if share.bucket is not None:
                share.bucket.tokens = tokens
                share.bucket.updated_at = now
            else:  # a share cut to nothing that still carries debt, as the limiter keeps it
                share.bucket = TokenBucket(capacity=1e-9, tokens=min(tokens, 0.0), updated_at=now)
        state.hold_ewma_s = hold
        return state

    def _remember(self, keys: Sequence[str], views: Sequence[_KeyState], now: float) -> None:
        self.server_time = max(self.server_time, now)
        seen = time.monotonic()
        for key, view in zip(keys, views, strict=True):
            self._cache.pop(key, None)  # re-insert: the dict stays ordered by last use
            self._cache[key] = _Cached(view, seen)
        if len(self._cache) > CACHE_MAX_KEYS:
            extra = [k for k in self._cache if k not in self._specs][: len(self._cache) - CACHE_MAX_KEYS]
            for key in extra:
                del self._cache[key]

    def _lease_key_ttl_ms(self) -> int:
        return math.ceil((self.lease_ttl_s + LEASE_KEY_MARGIN_S) * 1000)

    # -- background work -----------------------------------------------------------------------------------

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _forget_lease(self, member: str, keys: Sequence[str], holder: str | None) -> None:
        pairs: list[str] = []
        for key in keys:
            for share in dict.fromkeys([holder or SHARED, SHARED]):
                pairs += [key, share]
        for delay in RELEASE_RETRY_DELAYS_S:
            await asyncio.sleep(delay)
            try:
                await self._run(
                    self._forget, lambda: [member, *pairs], (), BACKGROUND_TIMEOUT_S, fail_fast=False
                )
                return
            except StoreUnavailable:
                continue

    def _retry_release(self, args: Callable[[], list[str]], keys: Sequence[str]) -> None:
        if len(self._background) >= MAX_PENDING_RETRIES:
            self.dropped_releases += 1
            return
        self._spawn(self._release_later(args, keys))

    async def _release_later(self, args: Callable[[], list[str]], keys: Sequence[str]) -> None:
        """Idempotent: the script settles only a lease still present, so a retry after a lost reply or after
        expiry is a no-op."""
        for delay in RELEASE_RETRY_DELAYS_S:
            await asyncio.sleep(delay)
            try:
                await self._run(self._release, args, keys, BACKGROUND_TIMEOUT_S, fail_fast=False)
                return
            except StoreUnavailable:
                continue
        self.dropped_releases += 1
        log.warning("redis store: release given up, the lease will expire", extra={"lease": args()[0]})

    async def _renew_loop(self) -> None:
        while True:
            await asyncio.sleep(self.renew_interval_s)
            try:
                await self.renew()
            except StoreUnavailable:
                log.warning("redis store: lease renewal failed", extra={"error": self.last_error})
            except Exception:
                log.exception("redis store: lease renewal failed")

    async def renew(self) -> int:
        """Push the expiry of every open lease of this replica one TTL ahead; returns the number renewed.

        One script call per 500 leases, sent together. Leases found expired are dropped
        from the renewal set and counted in `lost_leases`.
        """
        entries = list(self._open.values())
        if not entries:
            return 0
        chunks = [entries[i : i + 500] for i in range(0, len(entries), 500)]
        key_ttl = str(self._lease_key_ttl_ms())
        calls = []
        for chunk in chunks:
            args = [repr(self.lease_ttl_s), key_ttl, str(len(chunk))]
            for entry in chunk:
                places = entry.lease.placements
                args += [entry.member, str(len(places))]
                for placement in places:
                    args += [placement.key, placement.slot]
            calls.append(self._call(self._renew, args))
        # Concurrent calls rather than a pipeline: the same code then serves one Redis and a Cluster (whose
        # pipeline does not take scripts the same way), and a NOSCRIPT reply is handled per call.
        try:
            async with asyncio.timeout(BACKGROUND_TIMEOUT_S):
                results = await asyncio.gather(*calls)
        except CLIENT_ERRORS as exc:
            self._failed(exc)
            raise RedisUnavailable(f"redis: {self.last_error}") from exc
        lost = 0
        for chunk, indices in zip(chunks, results, strict=True):
            for index in indices:
                entry = chunk[int(index) - 1]
                if self._open.pop(entry.lease.lease_id, None) is not None:
                    lost += 1
        if lost:
            self.lost_leases += lost
            log.warning("redis store: leases expired before renewal", extra={"lost": lost})
        return len(entries) - lost

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_s)
            try:
                await self.refresh()
            except StoreUnavailable:
                pass
            except Exception:
                log.exception("redis store: metrics cache refresh failed")

    async def refresh(self) -> None:
        """Re-read configured keys and keys seen lately into the metrics cache; forget idle tenants."""
        cutoff = time.monotonic() - CACHE_IDLE_S
        for key in [k for k, c in self._cache.items() if k not in self._specs and c.seen_at < cutoff]:
            del self._cache[key]
        keys = list(dict.fromkeys([*self._specs, *self._cache]))
        if keys:
            await self._peek_keys(keys, "0", background=True)

    async def _scale_loop(self) -> None:
        """Re-send this replica's proposals, so they stay fresh and expired ones of dead replicas age out."""
        while True:
            await asyncio.sleep(SCALE_REFRESH_S)
            for key, scale in list(self._proposed.items()):
                try:
                    await self._propose(key, scale)
                except StoreUnavailable:
                    break
                except Exception:
                    log.exception("redis store: scale proposal failed")

    # -- waking waiters across replicas --------------------------------------------------------------------

    def on_wake(self, callback: Callable[[], None]) -> None:
        """Call `callback` whenever capacity may have freed on another replica (a release, a scale raised).

        Callbacks run on the event loop and must not block. They are also called after the subscription
        (re)connects, since messages sent while it was down are lost.
        """
        self._wake_callbacks.append(callback)
        if self._tasks and not any(t.get_name() == "redis-store-wake" for t in self._tasks):
            self._tasks.append(
                asyncio.get_running_loop().create_task(self._wake_loop(), name="redis-store-wake")
            )

    def announce_waiting(self) -> None:
        """This replica has requests queued: make releases on every replica publish wake-ups. Throttled; no
        wait on the caller's side (runs in the background, failures are ignored: the 100 ms tick remains)."""
        now = time.monotonic()
        if now < self._announced_until - (WAITING_ANNOUNCE_S - WAITING_REFRESH_S):
            return
        self._announced_until = now + WAITING_ANNOUNCE_S
        self._spawn(self._announce())

    async def _announce(self) -> None:
        ms = str(math.ceil(WAITING_ANNOUNCE_S * 1000))
        with contextlib.suppress(StoreUnavailable):
            await self._run(self._waiting, lambda: [ms], (), BACKGROUND_TIMEOUT_S, fail_fast=False)

    def _notify(self) -> None:
        for callback in self._wake_callbacks:
            try:
                callback()
            except Exception:
                log.exception("redis store: wake-up callback failed")

    async def _wake_loop(self) -> None:
        """Subscribe to the wake-up channel, reconnecting with backoff (Redis restarted, failed over)."""
        delay = WAKE_BACKOFF_S[0]
        channel = self.base + "wake"
        while not self._closed:
            pubsub = self.client.pubsub()
            try:
                await pubsub.subscribe(channel)
                delay = WAKE_BACKOFF_S[0]
                self._notify()  # whatever was published while not subscribed is lost: look once now
                while not self._closed:
                    message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
                    if message is not None and message.get("type") == "message":
                        self.wakeups += 1
                        self._notify()
            except RAW_CLIENT_ERRORS as exc:
                log.warning(
                    "redis store: wake-up subscription lost", extra={"error": f"{type(exc).__name__}"}
                )
            finally:
                with contextlib.suppress(Exception):
                    async with asyncio.timeout(BACKGROUND_TIMEOUT_S):
                        await pubsub.aclose()  # type: ignore[no-untyped-call]
            await asyncio.sleep(delay)
            delay = min(WAKE_BACKOFF_S[1], delay * 2)


def _num(value: float | None) -> str:
    return "" if value is None else repr(float(value))
