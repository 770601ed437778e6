"""The joint limiter: concurrency slots and a TPM bucket per key, admitted together or not at all.

A request names several keys (global, its model, its tenant). It is admitted only if every key has a free
slot and every key's bucket holds the reservation; otherwise nothing is taken and the rejection says which
key refused and when to come back. Slots are checked before tokens because a slot is the scarcer, longer-held
resource on an inference server: a request that fails the token check gives its slots straight back.

A key's capacity may be split into shares (see `shares.py`): guarantees held by priority classes that nobody
else can take, and a burstable pool any class borrows from once its own guarantee is in use. A request of
class `c` takes from `c`'s guarantee first and from the pool otherwise; the lease remembers which, so it is
given back to the same place. Under KV pressure the pool shrinks first, then the guarantees of the lowest
classes.

Leases settle exactly once. The end of a response, a client reset, a message timeout and a shutdown may all
try to settle the same lease; the first wins and the rest are no-ops, so capacity is never released twice.

Limits change at run time (config reload, adaptive scale). A lowered concurrency limit never evicts in-flight
work: it admits nothing until enough leases end. Key and share state outlive their configuration while
leases on them are open, so a reload cannot orphan a slot.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from extproc.core.bucket import TokenBucket
from extproc.core.clock import Clock
from extproc.core.shares import SHARED, effective_shares

HOLD_EWMA_ALPHA = 0.2
"""Weight of the newest lease duration in the per-key hold-time average used for slot retry hints."""

DEFAULT_HOLD_S = 1.0
"""Assumed lease duration for a key that has not settled any lease yet."""

SHRUNK_RETRY_S = 30.0
"""Retry hint for a request that fits the base TPM but not the current, pressure-scaled one."""


@dataclass(frozen=True)
class LimitSpec:
    """Base limits of one key; None means unlimited in that dimension.

    `guaranteed` holds per-class guarantees inside these limits, as (class, LimitSpec) pairs; the rest is
    the burstable pool. Guarantees must fit inside the totals they divide.
    """

    max_concurrency: int | None = None
    tokens_per_minute: int | None = None
    guaranteed: tuple[tuple[str, LimitSpec], ...] = ()

    def __post_init__(self) -> None:
        if self.max_concurrency is not None and self.max_concurrency < 0:
            raise ValueError("max_concurrency must be >= 0")
        if self.tokens_per_minute is not None and self.tokens_per_minute <= 0:
            raise ValueError("tokens_per_minute must be > 0")
        conc = sum(g.max_concurrency or 0 for _, g in self.guaranteed)
        tpm = sum(g.tokens_per_minute or 0 for _, g in self.guaranteed)
        if conc and (self.max_concurrency is None or conc > self.max_concurrency):
            raise ValueError(
                f"guaranteed max_concurrency adds up to {conc}, above the total {self.max_concurrency}"
            )
        if tpm and (self.tokens_per_minute is None or tpm > self.tokens_per_minute):
            raise ValueError(
                f"guaranteed tokens_per_minute adds up to {tpm}, above the total {self.tokens_per_minute}"
            )
        if any(g.guaranteed for _, g in self.guaranteed):
            raise ValueError("a guarantee cannot hold guarantees of its own")

    def guarantees(self) -> dict[str, LimitSpec]:
        return dict(self.guaranteed)


class Reason(StrEnum):
    CONCURRENCY = "concurrency"
    TOKENS = "tokens"
    TOO_LARGE = "request_exceeds_token_limit"


@dataclass(frozen=True)
class RateLimitStatus:
    """What the `x-ratelimit-*` headers report: the tightest key in each dimension (None: unlimited)."""

    limit_requests: int | None = None
    remaining_requests: int | None = None
    limit_tokens: int | None = None
    remaining_tokens: int | None = None
    reset_tokens_s: float | None = None
    reset_requests_s: float | None = None


@dataclass(frozen=True)
class Rejection:
    """Why a request was refused.

    `retry_after_s` is the exact refill wait for tokens and an estimate for slots; None when waiting cannot
    help (the request is larger than the bucket's base capacity).
    """

    reason: Reason
    key: str
    retry_after_s: float | None
    status: RateLimitStatus


@dataclass(frozen=True)
class Placement:
    """Where a lease took its slot and its tokens on one key (share names; None: nothing taken)."""

    key: str
    slot: str
    tokens: str | None


@dataclass
class Lease:
    """Capacity held by one admitted request until it is settled."""

    lease_id: int
    keys: tuple[str, ...]
    reserved_tokens: int
    acquired_at: float
    status: RateLimitStatus
    holder: str | None = None
    placements: tuple[Placement, ...] = ()
    settled: bool = False
    actual_tokens: int | None = None


@dataclass
class _Share:
    """One slice of a key: a class guarantee or the burstable pool."""

    concurrency: float | None = None  # effective slots (whole numbers); None: unlimited
    tokens_per_minute: float | None = None  # effective capacity; None: no bucket
    active: int = 0
    bucket: TokenBucket | None = None

    def free_slots(self) -> float:
        return math.inf if self.concurrency is None else self.concurrency - self.active

    def sync_bucket(self, now: float) -> None:
        capacity = self.tokens_per_minute
        if capacity is None:
            self.bucket = None
            return
        if capacity <= 0:
            # A share cut to nothing keeps its debt but admits nothing.
            if self.bucket is not None:
                self.bucket.refill(now)
                self.bucket.tokens = min(self.bucket.tokens, 0.0)
                self.bucket.capacity = 1e-9
            return
        if self.bucket is None:
            self.bucket = TokenBucket.full(capacity, now)
        elif self.bucket.capacity != capacity:
            self.bucket.resize(capacity, now)

    def usable_bucket(self) -> TokenBucket | None:
        if self.bucket is None or (self.tokens_per_minute or 0) <= 0:
            return None
        return self.bucket


@dataclass
class _KeyState:
    spec: LimitSpec
    priority: tuple[str, ...] = ()
    scale: float = 1.0
    shares: dict[str, _Share] = field(default_factory=dict)
    hold_ewma_s: float | None = None
    configured: bool = True

    def rebuild(self, now: float) -> None:
        """Recompute every share's effective capacity from the spec, the class priority and the scale."""
        spec = self.spec
        guarantees = spec.guarantees()
        conc = self._split(spec.max_concurrency, {c: g.max_concurrency for c, g in guarantees.items()}, True)
        tpm = self._split(
            spec.tokens_per_minute, {c: g.tokens_per_minute for c, g in guarantees.items()}, False
        )
        names = {SHARED, *guarantees}
        for name in names | set(self.shares):
            share = self.shares.setdefault(name, _Share())
            if name in names:
                share.concurrency = conc.get(name) if conc is not None else None
                share.tokens_per_minute = tpm.get(name) if tpm is not None else None
            else:  # a guarantee no longer configured: keeps its leases, admits nothing
                share.concurrency = 0.0
                share.tokens_per_minute = 0.0
            share.sync_bucket(now)
        for name in [n for n, s in self.shares.items() if n not in names and s.active == 0]:
            del self.shares[name]

    def _split(
        self, total: int | None, guarantees: Mapping[str, int | None], whole: bool
    ) -> dict[str, float] | None:
        if total is None:
            return None
        if total == 0:
            return dict.fromkeys([SHARED, *guarantees], 0.0)
        given = {c: float(v) for c, v in guarantees.items() if v}
        out = effective_shares(float(total), given, self.priority, self.scale, whole)
        for name in guarantees:
            out.setdefault(name, 0.0)
        return out

    @property
    def active(self) -> int:
        return sum(s.active for s in self.shares.values())

    def concurrency_limit(self) -> int | None:
        values = [s.concurrency for s in self.shares.values()]
        if any(v is None for v in values):
            return None
        return int(sum(v or 0.0 for v in values))

    def token_capacity(self) -> float | None:
        if self.spec.tokens_per_minute is None:
            return None
        return sum(s.tokens_per_minute or 0.0 for s in self.shares.values())

    def tokens_available(self) -> float | None:
        buckets = [s.bucket for s in self.shares.values() if s.bucket is not None]
        return sum(b.tokens for b in buckets) if buckets else None

    def candidates(self, holder: str | None, use_pool: bool = True) -> list[str]:
        """Shares a request of class `holder` may use, in the order it tries them."""
        own = [holder] if holder is not None and holder != SHARED and holder in self.shares else []
        return [*own, SHARED] if use_pool or not own else own

    def free_slots(self, name: str) -> float:
        """Free slots of a share. The pool also covers leases that sit above their own share's limit (a
        guarantee lowered or removed by a reload), so a reload can never put more in flight than the total.
        """
        share = self.shares[name]
        free = share.free_slots()
        if name == SHARED:
            free -= sum(
                max(0.0, s.active - s.concurrency)
                for n, s in self.shares.items()
                if n != SHARED and s.concurrency is not None
            )
        return free

    def place_slot(self, holder: str | None, use_pool: bool = True) -> str | None:
        for name in self.candidates(holder, use_pool):
            if self.free_slots(name) >= 1:
                return name
        return None

    def place_tokens(
        self, holder: str | None, tokens: int, now: float, use_pool: bool = True
    ) -> tuple[str | None, float]:
        """(share, 0) when a share can cover `tokens` now; else (None, wait), wait inf if never.

        "Never" is judged at base capacity over every share the class may use (the pool included even when
        it is withheld for now), so a request is only called too large when waiting cannot help.
        """
        if self.spec.tokens_per_minute is None:
            return None, 0.0
        fits_base = any(tokens <= self._base_tokens(n) for n in self.candidates(holder))
        if not fits_base:
            return None, math.inf
        best: float | None = None
        for name in self.candidates(holder, use_pool):
            bucket = self.shares[name].usable_bucket()
            if bucket is None:
                continue
            wait = bucket.wait_for(tokens, now)
            if wait == 0:
                return name, 0.0
            if not math.isinf(wait) and (best is None or wait < best):
                best = wait
        if best is not None:
            return None, best
        # Only the pool could hold it: shrunk by pressure, or withheld while higher classes wait.
        return None, (SHRUNK_RETRY_S if use_pool else DEFAULT_HOLD_S)

    def _base_tokens(self, name: str) -> float:
        """A share's capacity at scale 1: what waiting for pressure to pass could give it."""
        total = self.spec.tokens_per_minute or 0
        guarantees = {c: float(g.tokens_per_minute or 0) for c, g in self.spec.guaranteed}
        if name == SHARED:
            return max(0.0, total - sum(guarantees.values()))
        return guarantees.get(name, 0.0)

    def slot_retry_after(self, holder: str | None) -> float:
        """Expected wait for the first free slot: with `limit` slots each held ~H, one frees every H/limit."""
        usable = self.candidates(holder)
        limit = sum(self.shares[n].concurrency or 0.0 for n in usable) or 1.0
        active = sum(self.shares[n].active for n in usable)
        hold = self.hold_ewma_s if self.hold_ewma_s is not None else DEFAULT_HOLD_S
        excess = max(1.0, active - limit + 1)  # over a lowered limit, the extra leases must end first
        return hold * excess / limit

    def snapshot(self, key: str) -> KeySnapshot:
        """A read-only view of this key's state as it stands (buckets are not refilled here)."""
        shares = tuple(
            ShareSnapshot(
                name=name,
                effective_concurrency=share.concurrency,
                active=share.active,
                effective_tokens_per_minute=share.tokens_per_minute,
                tokens_available=share.bucket.tokens if share.bucket is not None else None,
            )
            for name, share in self.shares.items()
        )
        return KeySnapshot(
            key=key,
            max_concurrency=self.spec.max_concurrency,
            effective_concurrency=self.concurrency_limit(),
            active=self.active,
            tokens_per_minute=self.spec.tokens_per_minute,
            effective_tokens_per_minute=self.token_capacity(),
            tokens_available=self.tokens_available(),
            scale=self.scale,
            shares=shares,
        )

    def idle(self, now: float) -> bool:
        if self.scale != 1.0:
            return False  # forgetting it would drop the adaptive scale until the next sample
        for share in self.shares.values():
            if share.active:
                return False
            if share.bucket is not None and share.bucket.remaining(now) < math.floor(share.bucket.capacity):
                return False
        return True


@dataclass(frozen=True)
class KeySnapshot:
    """Read-only view of one key, for metrics and tests."""

    key: str
    max_concurrency: int | None
    effective_concurrency: int | None
    active: int
    tokens_per_minute: int | None
    effective_tokens_per_minute: float | None
    tokens_available: float | None
    scale: float
    shares: tuple[ShareSnapshot, ...] = ()


@dataclass(frozen=True)
class ShareSnapshot:
    name: str
    effective_concurrency: float | None
    active: int
    effective_tokens_per_minute: float | None
    tokens_available: float | None


@dataclass
class JointLimiter:
    """In-process joint limiter. Not thread-safe: all calls come from one event loop."""

    clock: Clock
    _keys: dict[str, _KeyState] = field(default_factory=dict)
    _ids: itertools.count[int] = field(default_factory=lambda: itertools.count(1))
    default_spec_by_prefix: dict[str, LimitSpec] = field(default_factory=dict)
    priority: tuple[str, ...] = ()

    # -- configuration -------------------------------------------------------------------------------------

    def apply_limits(
        self,
        specs: Mapping[str, LimitSpec],
        defaults: Mapping[str, LimitSpec] | None = None,
        priority: Sequence[str] = (),
    ) -> None:
        """Install a new set of base limits. Keys no longer named become unlimited but keep their leases.

        `defaults` maps a key prefix (e.g. "tenant:") to the limits a key gets the first time it is seen,
        for key families that are open-ended (tenants). `priority` lists the classes highest first: the
        order in which their guarantees are protected under pressure.
        """
        now = self.clock()
        self.default_spec_by_prefix = dict(defaults or {})
        self.priority = tuple(priority)
        for key, state in self._keys.items():
            state.priority = self.priority
            if key not in specs:
                state.spec = self._default_for(key) or LimitSpec()
                state.configured = False
                state.rebuild(now)
        for key, spec in specs.items():
            state = self._keys.setdefault(key, _KeyState(spec=spec, priority=self.priority))
            state.spec = spec
            state.configured = True
            state.rebuild(now)

    def set_scale(self, key: str, scale: float) -> None:
        """Multiply a key's base limits by `scale` (adaptive feedback); in-flight leases are kept."""
        if not 0 < scale <= 1:
            raise ValueError("scale must be in (0, 1]")
        state = self._state(key)
        if state.scale != scale:
            state.scale = scale
            state.rebuild(self.clock())

    def _default_for(self, key: str) -> LimitSpec | None:
        for prefix, spec in self.default_spec_by_prefix.items():
            if key.startswith(prefix):
                return spec
        return None

    def _state(self, key: str) -> _KeyState:
        state = self._keys.get(key)
        if state is None:
            state = _KeyState(
                spec=self._default_for(key) or LimitSpec(), priority=self.priority, configured=False
            )
            state.rebuild(self.clock())
            self._keys[key] = state
        return state

    # -- admission -----------------------------------------------------------------------------------------

    def acquire(
        self, keys: Sequence[str], tokens: int, holder: str | None = None, use_pool: bool = True
    ) -> Lease | Rejection:
        """Admit a request of class `holder` holding one slot and `tokens` on each key, or refuse it.

        `use_pool=False` restricts it to its class's own guarantee (when higher classes wait for the pool).
        """
        if tokens < 0:
            raise ValueError("tokens must be >= 0")
        now = self.clock()
        unique = tuple(dict.fromkeys(keys))
        states = [self._state(k) for k in unique]

        slots: list[str] = []
        for key, state in zip(unique, states, strict=True):
            slot = state.place_slot(holder, use_pool)
            if slot is None:
                retry = state.slot_retry_after(holder)
                return Rejection(Reason.CONCURRENCY, key, retry, self._status(unique, states, holder, now))
            slots.append(slot)

        placed: list[str | None] = []
        worst: tuple[float, str] | None = None
        for key, state in zip(unique, states, strict=True):
            share, wait = state.place_tokens(holder, tokens, now, use_pool)
            if math.isinf(wait):
                return Rejection(Reason.TOO_LARGE, key, None, self._status(unique, states, holder, now))
            if wait > 0 and (worst is None or wait > worst[0]):
                worst = (wait, key)
            placed.append(share)
        if worst is not None:
            return Rejection(Reason.TOKENS, worst[1], worst[0], self._status(unique, states, holder, now))

        placements = []
        for key, state, slot, share in zip(unique, states, slots, placed, strict=True):
            state.shares[slot].active += 1
            if share is not None:
                bucket = state.shares[share].bucket
                assert bucket is not None
                bucket.take(tokens, now)
            placements.append(Placement(key, slot, share))
        return Lease(
            lease_id=next(self._ids),
            keys=unique,
            reserved_tokens=tokens,
            acquired_at=now,
            status=self._status(unique, states, holder, now),
            holder=holder,
            placements=tuple(placements),
        )

    def release(self, lease: Lease, actual_tokens: int) -> bool:
        """Settle a lease to the tokens really used. Returns False if it was already settled."""
        if lease.settled:
            return False
        lease.settled = True
        lease.actual_tokens = max(0, actual_tokens)
        now = self.clock()
        held = max(0.0, now - lease.acquired_at)
        for placement in lease.placements:
            state = self._state(placement.key)
            slot = state.shares.get(placement.slot)
            if slot is not None:
                slot.active = max(0, slot.active - 1)
            if placement.tokens is not None:
                share = state.shares.get(placement.tokens)
                if share is not None and share.bucket is not None:
                    share.bucket.settle(lease.reserved_tokens, lease.actual_tokens, now)
            state.hold_ewma_s = (
                held
                if state.hold_ewma_s is None
                else (1 - HOLD_EWMA_ALPHA) * state.hold_ewma_s + HOLD_EWMA_ALPHA * held
            )
            if slot is not None and slot.concurrency == 0 and slot.active == 0:
                state.rebuild(now)  # drops a share whose guarantee was removed once it is empty
        return True

    def refund(self, lease: Lease, tokens: int) -> bool:
        """Lower an open lease's reservation by `tokens` (at most what it holds), returning them to the
        buckets it took from, as its settlement would (never above capacity). False once it is settled."""
        if lease.settled:
            return False
        tokens = max(0, min(tokens, lease.reserved_tokens))
        now = self.clock()
        for placement in lease.placements:
            if placement.tokens is None:
                continue
            share = self._state(placement.key).shares.get(placement.tokens)
            if share is not None and share.bucket is not None:
                share.bucket.settle(tokens, 0, now)
        lease.reserved_tokens -= tokens
        return True

    def status(self, keys: Sequence[str], holder: str | None = None) -> RateLimitStatus:
        unique = tuple(dict.fromkeys(keys))
        return self._status(unique, [self._state(k) for k in unique], holder, self.clock())

    def _status(
        self, keys: Sequence[str], states: Sequence[_KeyState], holder: str | None, now: float
    ) -> RateLimitStatus:
        """The tightest key for a request of class `holder`: its guarantee plus the burstable pool."""
        req: tuple[int, int, float] | None = None
        tok: tuple[int, int, float] | None = None
        for state in states:
            names = state.candidates(holder)
            usable = [state.shares[n] for n in names]
            if all(s.concurrency is not None for s in usable):
                limit = int(sum(s.concurrency or 0.0 for s in usable))
                remaining = int(sum(max(0.0, state.free_slots(n)) for n in names))
                if req is None or remaining < req[1]:
                    req = (limit, remaining, 0.0 if remaining else state.slot_retry_after(holder))
            buckets = [s.bucket for s in usable if s.usable_bucket() is not None]
            if buckets:
                capacity = sum(b.capacity for b in buckets if b is not None)
                remaining_t = sum(b.remaining(now) for b in buckets if b is not None)
                reset = max(b.seconds_until_full(now) for b in buckets if b is not None)
                if tok is None or remaining_t < tok[1]:
                    tok = (math.floor(capacity), remaining_t, reset)
        return RateLimitStatus(
            limit_requests=req[0] if req else None,
            remaining_requests=req[1] if req else None,
            reset_requests_s=req[2] if req else None,
            limit_tokens=tok[0] if tok else None,
            remaining_tokens=tok[1] if tok else None,
            reset_tokens_s=tok[2] if tok else None,
        )

    # -- housekeeping and observation ---------------------------------------------------------------------

    def prune(self) -> int:
        """Forget unconfigured keys that hold nothing (idle tenants): open-ended key families stay bounded."""
        now = self.clock()
        dead = [k for k, s in self._keys.items() if not s.configured and s.idle(now)]
        for key in dead:
            del self._keys[key]
        return len(dead)

    def snapshot(self, keys: Iterable[str] | None = None) -> list[KeySnapshot]:
        now = self.clock()
        names = list(self._keys) if keys is None else [k for k in keys if k in self._keys]
        out = []
        for key in names:
            state = self._keys[key]
            for share in state.shares.values():
                if share.bucket is not None:
                    share.bucket.refill(now)
            out.append(state.snapshot(key))
        return out
