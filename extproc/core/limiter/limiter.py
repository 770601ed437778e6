"""The joint limiter: concurrency slots and a TPM bucket per key, admitted together or not at all.

A request names several keys (global, its model, its tenant). It is admitted only if every key has a free
slot and every key's bucket holds the reservation; otherwise nothing is taken and the rejection says which
key refused and when to come back. A key's bucket holds its part of the reservation: the whole of it, or,
for the derived keys of split input/output limits (`split.py`), the prompt or the reserved completion; a
refusal on one of those names its bucket (`token_reason`). Slots are checked before tokens because a slot
is the scarcer, longer-held resource on an inference server: a request that fails the token check gives its
slots straight back.

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

A reload costs the event loop next to nothing whatever the number of keys it names: `apply_limits` swaps the
table of specs in one step and marks every key's state stale (a generation number); a key is brought up to
date the next time anything touches it, from the spec in force and at the instant of the reload, so each
request is judged wholly under the old limits or wholly under the new ones, never a mix. A key whose spec
did not change is not rebuilt at all. Only the first `EAGER_KEYS` configured keys (the global key and the
models come first) are created at once, so that their gauges exist before any traffic; the others (10^5
tenants with limits of their own) are created on first use and forgotten again when idle.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from extproc.core.clock import Clock
from extproc.core.limiter.split import INPUT_PREFIX, OUTPUT_PREFIX, key_tokens
from extproc.core.limiter.state import (
    DEFAULT_HOLD_S,
    SHRUNK_RETRY_S,
    KeySnapshot,
    KeyState,
    LimitSpec,
    RateLimitStatus,
    ShareSnapshot,
    tightest_status,
)

__all__ = [
    "DEFAULT_HOLD_S",
    "EAGER_KEYS",
    "HOLD_EWMA_ALPHA",
    "SHRUNK_RETRY_S",
    "SNAPSHOT_BUSIEST_KEYS",
    "TOKEN_REASONS",
    "JointLimiter",
    "KeySnapshot",
    "Lease",
    "LimitSpec",
    "Placement",
    "RateLimitStatus",
    "Reason",
    "Rejection",
    "ShareSnapshot",
    "token_reason",
]

HOLD_EWMA_ALPHA = 0.2
"""Weight of the newest lease duration in the per-key hold-time average used for slot retry hints."""

EAGER_KEYS = 1000
"""Configured keys created when limits are applied (in the order given); the rest wait for their first use."""

SNAPSHOT_BUSIEST_KEYS = 100
"""Keys besides the first `EAGER_KEYS` configured ones that `shown_keys` names: the most leases held."""


class Reason(StrEnum):
    CONCURRENCY = "concurrency"
    TOKENS = "tokens"
    INPUT_TOKENS = "input_tokens"
    OUTPUT_TOKENS = "output_tokens"
    TOO_LARGE = "request_exceeds_token_limit"


def token_reason(key: str) -> Reason:
    """The refusal of a key whose bucket cannot hold its part yet: which bucket, by the key (`split.py`)."""
    if key.startswith(INPUT_PREFIX):
        return Reason.INPUT_TOKENS
    if key.startswith(OUTPUT_PREFIX):
        return Reason.OUTPUT_TOKENS
    return Reason.TOKENS


TOKEN_REASONS = (Reason.TOKENS, Reason.INPUT_TOKENS, Reason.OUTPUT_TOKENS)
"""Refusals a bucket's refill ends: waiting helps."""


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
    """Capacity held by one admitted request until it is settled.

    `reserved_tokens` is the whole reservation, `reserved_output` the completion part of it: each key's
    bucket holds `key_tokens(key, reserved_tokens, reserved_output)` (`split.py`).
    """

    lease_id: int
    keys: tuple[str, ...]
    reserved_tokens: int
    acquired_at: float
    status: RateLimitStatus
    holder: str | None = None
    placements: tuple[Placement, ...] = ()
    settled: bool = False
    actual_tokens: int | None = None
    reserved_output: int = 0
    actual_output: int = 0
    slot_released: bool = False
    """Its slots were given back before its settlement (`release_slot`: the engine finished while the client
    still reads); its tokens stay reserved until `release` settles them."""

    def reserved_on(self, key: str) -> int:
        return key_tokens(key, self.reserved_tokens, self.reserved_output)

    def actual_on(self, key: str) -> int:
        return key_tokens(key, self.actual_tokens or 0, self.actual_output)


@dataclass
class JointLimiter:
    """In-process joint limiter. Not thread-safe: all calls come from one event loop."""

    clock: Clock
    _keys: dict[str, KeyState] = field(default_factory=dict)
    _ids: itertools.count[int] = field(default_factory=lambda: itertools.count(1))
    default_spec_by_prefix: dict[str, LimitSpec] = field(default_factory=dict)
    priority: tuple[str, ...] = ()
    _specs: dict[str, LimitSpec] = field(default_factory=dict)
    _eager: frozenset[str] = frozenset()
    _generation: int = 0
    _applied_at: float = 0.0

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
        order in which their guarantees are protected under pressure. Existing keys are brought up to date
        lazily (see the module docstring); the cost here is one copy of `specs` and `EAGER_KEYS` keys.
        """
        self._applied_at = self.clock()
        self._specs = dict(specs)
        self.default_spec_by_prefix = dict(defaults or {})
        self.priority = tuple(priority)
        self._generation += 1
        self._eager = frozenset(itertools.islice(self._specs, EAGER_KEYS))
        for key in self._eager:
            self._state(key)

    def set_scale(self, key: str, scale: float) -> None:
        """Multiply a key's base limits by `scale` (adaptive feedback); in-flight leases are kept."""
        if not 0 < scale <= 1:
            raise ValueError("scale must be in (0, 1]")
        state = self._state(key)
        if state.scale != scale:
            state.scale = scale
            state.rebuild(self.clock())

    def _spec_for(self, key: str) -> tuple[LimitSpec, bool]:
        """The key's spec in force and whether it is configured (else a prefix default, or unlimited)."""
        spec = self._specs.get(key)
        if spec is not None:
            return spec, True
        for prefix, default in self.default_spec_by_prefix.items():
            if key.startswith(prefix):
                return default, False
        return LimitSpec(), False

    def _state(self, key: str) -> KeyState:
        """The key's state under the limits in force: created on first use, brought up to date if stale."""
        state = self._keys.get(key)
        if state is None:
            spec, configured = self._spec_for(key)
            state = KeyState(
                spec=spec, priority=self.priority, configured=configured, generation=self._generation
            )
            state.rebuild(self.clock())
            self._keys[key] = state
        elif state.generation != self._generation:
            spec, configured = self._spec_for(key)
            state.reconfigure(spec, self.priority, configured, self._applied_at)
            state.generation = self._generation
        return state

    # -- admission -----------------------------------------------------------------------------------------

    def acquire(
        self,
        keys: Sequence[str],
        tokens: int,
        holder: str | None = None,
        use_pool: bool = True,
        output_tokens: int = 0,
    ) -> Lease | Rejection:
        """Admit a request of class `holder` holding one slot and `tokens` on each key, or refuse it;
        `output_tokens` of `tokens` are completion (an `output:` key holds those, an `input:` key the rest).

        `use_pool=False` restricts it to its class's own guarantee (when higher classes wait for the pool).
        """
        if tokens < 0 or not 0 <= output_tokens <= tokens:
            raise ValueError("tokens must be >= 0, output_tokens between 0 and tokens")
        now = self.clock()
        unique = tuple(dict.fromkeys(keys))
        states = [self._state(k) for k in unique]

        slots: list[str] = []
        for key, state in zip(unique, states, strict=True):
            slot = state.place_slot(holder, use_pool)
            if slot is None:
                retry = state.slot_retry_after(holder)
                return Rejection(Reason.CONCURRENCY, key, retry, tightest_status(unique, states, holder, now))
            slots.append(slot)

        placed: list[str | None] = []
        worst: tuple[float, str] | None = None
        for key, state in zip(unique, states, strict=True):
            share, wait = state.place_tokens(holder, key_tokens(key, tokens, output_tokens), now, use_pool)
            if math.isinf(wait):
                return Rejection(Reason.TOO_LARGE, key, None, tightest_status(unique, states, holder, now))
            if wait > 0 and (worst is None or wait > worst[0]):
                worst = (wait, key)
            placed.append(share)
        if worst is not None:
            status = tightest_status(unique, states, holder, now)
            return Rejection(token_reason(worst[1]), worst[1], worst[0], status)

        placements = []
        for key, state, slot, share in zip(unique, states, slots, placed, strict=True):
            state.shares[slot].active += 1
            if share is not None:
                bucket = state.shares[share].bucket
                assert bucket is not None
                bucket.take(key_tokens(key, tokens, output_tokens), now)
            placements.append(Placement(key, slot, share))
        return Lease(
            lease_id=next(self._ids),
            keys=unique,
            reserved_tokens=tokens,
            acquired_at=now,
            status=tightest_status(unique, states, holder, now),
            holder=holder,
            placements=tuple(placements),
            reserved_output=output_tokens,
        )

    def release(self, lease: Lease, actual_tokens: int, actual_output: int = 0) -> bool:
        """Settle a lease to the tokens really used, `actual_output` of them completion, and give back its
        slots unless `release_slot` did. Returns False if it was already settled."""
        if lease.settled:
            return False
        lease.settled = True
        lease.actual_tokens = max(0, actual_tokens)
        lease.actual_output = max(0, actual_output)
        now = self.clock()
        for placement in lease.placements:
            if placement.tokens is None:
                continue
            share = self._state(placement.key).shares.get(placement.tokens)
            if share is not None and share.bucket is not None:
                share.bucket.settle(lease.reserved_on(placement.key), lease.actual_on(placement.key), now)
        if not lease.slot_released:
            self._free_slots(lease, now)
        return True

    def release_slot(self, lease: Lease) -> bool:
        """Give back an open lease's slots now and keep its tokens reserved until `release` settles them to
        what was used (the engine finished the request while its client still reads the answer). False when
        the lease is settled or its slots were given back before: a slot is never freed twice."""
        if lease.settled or lease.slot_released:
            return False
        lease.slot_released = True
        self._free_slots(lease, self.clock())
        return True

    def _free_slots(self, lease: Lease, now: float) -> None:
        """One slot back on every key the lease holds, and its hold time into the slot retry hints."""
        held = max(0.0, now - lease.acquired_at)
        for placement in lease.placements:
            state = self._state(placement.key)
            slot = state.shares.get(placement.slot)
            if slot is not None:
                slot.active = max(0, slot.active - 1)
            state.hold_ewma_s = (
                held
                if state.hold_ewma_s is None
                else (1 - HOLD_EWMA_ALPHA) * state.hold_ewma_s + HOLD_EWMA_ALPHA * held
            )
            if slot is not None and slot.concurrency == 0 and slot.active == 0:
                state.rebuild(now)  # drops a share whose guarantee was removed once it is empty

    def refund(self, lease: Lease, tokens: int) -> bool:
        """Lower an open lease's reservation by `tokens` prompt tokens (at most what it holds for the prompt),
        returning them to the buckets it took from, as its settlement would (never above capacity): the
        total and input buckets, not the output ones. False once it is settled, or when it holds no prompt
        tokens to give back (as the Redis store answers)."""
        tokens = max(0, min(tokens, lease.reserved_tokens - lease.reserved_output))
        if lease.settled or tokens == 0:
            return False
        now = self.clock()
        for placement in lease.placements:
            if placement.tokens is None:
                continue
            share = self._state(placement.key).shares.get(placement.tokens)
            if share is not None and share.bucket is not None:
                share.bucket.settle(key_tokens(placement.key, tokens, 0), 0, now)
        lease.reserved_tokens -= tokens
        return True

    def status(self, keys: Sequence[str], holder: str | None = None) -> RateLimitStatus:
        unique = tuple(dict.fromkeys(keys))
        return tightest_status(unique, [self._state(k) for k in unique], holder, self.clock())

    # -- housekeeping and observation ---------------------------------------------------------------------

    def prune(self) -> int:
        """Forget idle keys that would be created again as they are: unconfigured ones (idle tenants) and
        configured ones past the first `EAGER_KEYS`, so open-ended key families stay bounded by use."""
        now = self.clock()
        dead = [k for k in self._keys if k not in self._eager and self._state(k).idle(now)]
        for key in dead:
            del self._keys[key]
        return len(dead)

    def shown_keys(self, busiest: int = SNAPSHOT_BUSIEST_KEYS) -> list[str]:
        """The keys worth a metrics series: the first `EAGER_KEYS` configured keys, then the `busiest` other
        keys in use, most leases first. Ranking reads one counter per key in use, so a scrape costs the
        same whether 10 or 10^5 tenants have limits of their own."""
        others = (k for k in self._keys if k not in self._eager)
        ranked = heapq.nlargest(busiest, others, key=lambda k: self._keys[k].active)
        return [*itertools.islice(self._specs, EAGER_KEYS), *ranked]

    def snapshot(self, keys: Iterable[str] | None = None) -> list[KeySnapshot]:
        """Keys in use (and the first `EAGER_KEYS` configured ones), or those of `keys` that are."""
        now = self.clock()
        names = list(self._keys) if keys is None else [k for k in keys if k in self._keys]
        out = []
        for key in names:
            state = self._state(key)
            for share in state.shares.values():
                if share.bucket is not None:
                    share.bucket.refill(now)
            out.append(state.snapshot(key))
        return out
