"""The per-key state of the joint limiter, public so that every store computes with the same code.

The in-process limiter (`limiter.py`) holds these objects for good; the Redis store rebuilds them from what a
script returns and asks them the same questions (free slots, where tokens fit, retry hints, the tightest
status), so both stores derive refusals and `x-ratelimit-*` headers from one implementation. A key's capacity
is split into shares (see `shares.py`): class guarantees and the burstable pool.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from extproc.core.limiter.bucket import TokenBucket
from extproc.core.limiter.shares import SHARED, effective_shares

DEFAULT_HOLD_S = 1.0
"""Assumed lease duration for a key that has not settled any lease yet."""

SHRUNK_RETRY_S = 30.0
"""Retry hint for a request that fits the base TPM but not the current, pressure-scaled one."""


@dataclass(frozen=True)
class LimitSpec:
    """Base limits of one key; None means unlimited in that dimension.

    `guaranteed` holds per-class guarantees inside these limits, as (class, LimitSpec) pairs; the rest is
    the burstable pool. Guarantees must fit inside the totals they divide. `input_tokens_per_minute` and
    `output_tokens_per_minute` are enforced by derived keys of their own (`split.py`), not by this key's
    state, which ignores them.
    """

    max_concurrency: int | None = None
    tokens_per_minute: int | None = None
    guaranteed: tuple[tuple[str, LimitSpec], ...] = ()
    input_tokens_per_minute: int | None = None
    output_tokens_per_minute: int | None = None

    def __post_init__(self) -> None:
        if self.max_concurrency is not None and self.max_concurrency < 0:
            raise ValueError("max_concurrency must be >= 0")
        for name in ("tokens_per_minute", "input_tokens_per_minute", "output_tokens_per_minute"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be > 0")
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


@dataclass(frozen=True)
class RateLimitStatus:
    """What the `x-ratelimit-*` headers report: the tightest key in each dimension (None: unlimited)."""

    limit_requests: int | None = None
    remaining_requests: int | None = None
    limit_tokens: int | None = None
    remaining_tokens: int | None = None
    reset_tokens_s: float | None = None
    reset_requests_s: float | None = None


@dataclass
class Share:
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
class KeyState:
    spec: LimitSpec
    priority: tuple[str, ...] = ()
    scale: float = 1.0
    shares: dict[str, Share] = field(default_factory=dict)
    hold_ewma_s: float | None = None
    configured: bool = True
    generation: int = 0
    """The limits version this state was last brought up to date with (see `JointLimiter`)."""

    def reconfigure(
        self, spec: LimitSpec, priority: tuple[str, ...], configured: bool, applied_at: float
    ) -> None:
        """Take a reload's spec and class priority, rebuilt as of `applied_at`, the instant of the reload
        (nothing touched this state since, so its buckets are refilled at the old rate up to then and at
        the new one after, as if rebuilt at once). An unchanged spec costs nothing."""
        self.configured = configured
        if spec == self.spec and priority == self.priority:
            return
        self.spec = spec
        self.priority = priority
        self.rebuild(applied_at)

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
            share = self.shares.setdefault(name, Share())
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
        fits_base = any(tokens <= self.base_tokens(n) for n in self.candidates(holder))
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

    def base_tokens(self, name: str) -> float:
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


def tightest_status(
    keys: Sequence[str], states: Sequence[KeyState], holder: str | None, now: float
) -> RateLimitStatus:
    """The tightest of `keys` (with their `states`) for a request of class `holder`: its guarantee plus the
    burstable pool, in each dimension."""
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
