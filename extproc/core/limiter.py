"""The joint limiter: concurrency slots and a TPM bucket per key, admitted together or not at all.

A request names several keys (global, its model, its tenant). It is admitted only if every key has a free
slot and every key's bucket holds the reservation; otherwise nothing is taken and the rejection says which
key refused and when to come back. Slots are checked before tokens because a slot is the scarcer, longer-held
resource on an inference server: a request that fails the token check gives its slots straight back.

Leases settle exactly once. The end of a response, a client reset, a message timeout and a shutdown may all
try to settle the same lease; the first wins and the rest are no-ops, so capacity is never released twice.

Limits change at run time (config reload, adaptive scale). A lowered concurrency limit never evicts in-flight
work: it admits nothing until enough leases end. Key state outlives its configuration while leases on it
are open, so a reload cannot orphan a slot.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from extproc.core.bucket import TokenBucket
from extproc.core.clock import Clock

HOLD_EWMA_ALPHA = 0.2
"""Weight of the newest lease duration in the per-key hold-time average used for slot retry hints."""

DEFAULT_HOLD_S = 1.0
"""Assumed lease duration for a key that has not settled any lease yet."""


@dataclass(frozen=True)
class LimitSpec:
    """Base limits of one key; None means unlimited in that dimension."""

    max_concurrency: int | None = None
    tokens_per_minute: int | None = None

    def __post_init__(self) -> None:
        if self.max_concurrency is not None and self.max_concurrency < 0:
            raise ValueError("max_concurrency must be >= 0")
        if self.tokens_per_minute is not None and self.tokens_per_minute <= 0:
            raise ValueError("tokens_per_minute must be > 0")


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
    help (the request is larger than the bucket's capacity).
    """

    reason: Reason
    key: str
    retry_after_s: float | None
    status: RateLimitStatus


@dataclass
class Lease:
    """Capacity held by one admitted request until it is settled."""

    lease_id: int
    keys: tuple[str, ...]
    reserved_tokens: int
    acquired_at: float
    status: RateLimitStatus
    settled: bool = False
    actual_tokens: int | None = None


@dataclass
class _KeyState:
    spec: LimitSpec
    scale: float = 1.0
    active: int = 0
    bucket: TokenBucket | None = None
    hold_ewma_s: float | None = None
    configured: bool = True

    def concurrency_limit(self) -> int | None:
        if self.spec.max_concurrency is None:
            return None
        if self.spec.max_concurrency == 0:
            return 0
        return max(1, math.floor(self.spec.max_concurrency * self.scale))

    def token_capacity(self) -> float | None:
        if self.spec.tokens_per_minute is None:
            return None
        return max(1.0, self.spec.tokens_per_minute * self.scale)

    def sync_bucket(self, now: float) -> None:
        capacity = self.token_capacity()
        if capacity is None:
            self.bucket = None
        elif self.bucket is None:
            self.bucket = TokenBucket.full(capacity, now)
        elif self.bucket.capacity != capacity:
            self.bucket.resize(capacity, now)

    def slot_retry_after(self) -> float:
        """Expected wait for the first free slot: with `limit` slots each held ~H, one frees every H/limit."""
        limit = self.concurrency_limit() or 1
        hold = self.hold_ewma_s if self.hold_ewma_s is not None else DEFAULT_HOLD_S
        # Over a lowered limit, the extra leases must end first.
        excess = max(0, self.active - limit + 1)
        return hold * excess / limit

    def idle(self, now: float) -> bool:
        if self.active:
            return False
        return self.bucket is None or self.bucket.remaining(now) >= math.floor(self.bucket.capacity)


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


@dataclass
class JointLimiter:
    """In-process joint limiter. Not thread-safe: all calls come from one event loop."""

    clock: Clock
    _keys: dict[str, _KeyState] = field(default_factory=dict)
    _ids: itertools.count[int] = field(default_factory=lambda: itertools.count(1))
    default_spec_by_prefix: dict[str, LimitSpec] = field(default_factory=dict)

    # -- configuration -------------------------------------------------------------------------------------

    def apply_limits(
        self, specs: Mapping[str, LimitSpec], defaults: Mapping[str, LimitSpec] | None = None
    ) -> None:
        """Install a new set of base limits. Keys no longer named become unlimited but keep their leases.

        `defaults` maps a key prefix (e.g. "tenant:") to the limits a key gets the first time it is seen,
        for key families that are open-ended (tenants).
        """
        now = self.clock()
        self.default_spec_by_prefix = dict(defaults or {})
        for key, state in self._keys.items():
            if key not in specs:
                state.spec = self._default_for(key) or LimitSpec()
                state.configured = False
                state.sync_bucket(now)
        for key, spec in specs.items():
            configured = self._keys.setdefault(key, _KeyState(spec=spec))
            configured.spec = spec
            configured.configured = True
            configured.sync_bucket(now)

    def set_scale(self, key: str, scale: float) -> None:
        """Multiply a key's base limits by `scale` (adaptive feedback); in-flight leases are kept."""
        if not 0 < scale <= 1:
            raise ValueError("scale must be in (0, 1]")
        state = self._state(key)
        if state.scale != scale:
            state.scale = scale
            state.sync_bucket(self.clock())

    def _default_for(self, key: str) -> LimitSpec | None:
        for prefix, spec in self.default_spec_by_prefix.items():
            if key.startswith(prefix):
                return spec
        return None

    def _state(self, key: str) -> _KeyState:
        state = self._keys.get(key)
        if state is None:
            state = _KeyState(spec=self._default_for(key) or LimitSpec(), configured=False)
            state.sync_bucket(self.clock())
            self._keys[key] = state
        return state

    # -- admission -----------------------------------------------------------------------------------------

    def acquire(self, keys: Sequence[str], tokens: int) -> Lease | Rejection:
        """Admit a request holding one slot on each key and `tokens` from each key's bucket, or refuse it."""
        if tokens < 0:
            raise ValueError("tokens must be >= 0")
        now = self.clock()
        unique = tuple(dict.fromkeys(keys))
        states = [self._state(k) for k in unique]

        for key, state in zip(unique, states, strict=True):
            limit = state.concurrency_limit()
            if limit is not None and state.active >= limit:
                retry = state.slot_retry_after()
                return Rejection(Reason.CONCURRENCY, key, retry, self._status(unique, states, now))

        worst: tuple[float, str] | None = None
        for key, state in zip(unique, states, strict=True):
            if state.bucket is None:
                continue
            wait = state.bucket.wait_for(tokens, now)
            if math.isinf(wait):
                return Rejection(Reason.TOO_LARGE, key, None, self._status(unique, states, now))
            if wait > 0 and (worst is None or wait > worst[0]):
                worst = (wait, key)
        if worst is not None:
            return Rejection(Reason.TOKENS, worst[1], worst[0], self._status(unique, states, now))

        for state in states:
            state.active += 1
            if state.bucket is not None:
                state.bucket.take(tokens, now)
        return Lease(
            lease_id=next(self._ids),
            keys=unique,
            reserved_tokens=tokens,
            acquired_at=now,
            status=self._status(unique, states, now),
        )

    def release(self, lease: Lease, actual_tokens: int) -> bool:
        """Settle a lease to the tokens really used. Returns False if it was already settled."""
        if lease.settled:
            return False
        lease.settled = True
        lease.actual_tokens = max(0, actual_tokens)
        now = self.clock()
        held = max(0.0, now - lease.acquired_at)
        for key in lease.keys:
            state = self._state(key)
            state.active = max(0, state.active - 1)
            if state.bucket is not None:
                state.bucket.settle(lease.reserved_tokens, lease.actual_tokens, now)
            state.hold_ewma_s = (
                held
                if state.hold_ewma_s is None
                else (1 - HOLD_EWMA_ALPHA) * state.hold_ewma_s + HOLD_EWMA_ALPHA * held
            )
        return True

    def status(self, keys: Sequence[str]) -> RateLimitStatus:
        unique = tuple(dict.fromkeys(keys))
        return self._status(unique, [self._state(k) for k in unique], self.clock())

    def _status(self, keys: Sequence[str], states: Sequence[_KeyState], now: float) -> RateLimitStatus:
        req: tuple[int, int, float] | None = None
        tok: tuple[int, int, float] | None = None
        for state in states:
            limit = state.concurrency_limit()
            if limit is not None:
                remaining = max(0, limit - state.active)
                if req is None or remaining < req[1]:
                    req = (limit, remaining, 0.0 if remaining else state.slot_retry_after())
            if state.bucket is not None:
                remaining_t = state.bucket.remaining(now)
                if tok is None or remaining_t < tok[1]:
                    tok = (
                        math.floor(state.bucket.capacity),
                        remaining_t,
                        state.bucket.seconds_until_full(now),
                    )
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
            bucket = state.bucket
            if bucket is not None:
                bucket.refill(now)
            out.append(
                KeySnapshot(
                    key=key,
                    max_concurrency=state.spec.max_concurrency,
                    effective_concurrency=state.concurrency_limit(),
                    active=state.active,
                    tokens_per_minute=state.spec.tokens_per_minute,
                    effective_tokens_per_minute=state.token_capacity(),
                    tokens_available=bucket.tokens if bucket is not None else None,
                    scale=state.scale,
                )
            )
        return out
