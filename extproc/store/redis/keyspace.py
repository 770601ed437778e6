"""What this replica knows about each limiter key: its configured limits, the effective scale Redis stores
for it, the KEYSPEC argument block the scripts take, and the key's state rebuilt from a script's reply (and
an acquire's refusal from it, `refusal`).

Each replica reads the same config, so each computes the same effective shares (slots and token capacity per
class guarantee and for the burstable pool); only the counts live in Redis. The state a script returns is
rebuilt into the core's `KeyState`, the very object the in-process limiter holds, so refusals, retry hints
and statuses come from one implementation (`extproc.core.limiter.state`).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from extproc.core.limiter.bucket import TokenBucket
from extproc.core.limiter.limiter import EAGER_KEYS, Reason, Rejection, token_reason
from extproc.core.limiter.state import KeyState, LimitSpec, RateLimitStatus, Share

CACHE_MAX_KEYS = 4096
"""Bound on the keys whose KEYSPEC block and metrics view are kept (unconfigured tenants come and go)."""

ShareReading = tuple[str, int, float | None]
"""One share as a script returns it: name, active leases, tokens (None: no bucket)."""


class Keyspace:
    """Configured limits and stored scales of every key, and the script arguments built from them."""

    def __init__(self) -> None:
        self.specs: dict[str, LimitSpec] = {}
        self.defaults: dict[str, LimitSpec] = {}
        self.priority: tuple[str, ...] = ()
        self.configured = False
        self.eager: frozenset[str] = frozenset()
        """The first `EAGER_KEYS` configured keys: always in the metrics cache, as the in-process store."""
        self._blocks: dict[str, list[str]] = {}
        self._scales: dict[str, float] = {}  # the effective scale of each key, as last stored in Redis

    def configure(
        self,
        specs: Mapping[str, LimitSpec],
        defaults: Mapping[str, LimitSpec] | None,
        priority: Sequence[str],
    ) -> None:
        self.specs = dict(specs)
        self.defaults = dict(defaults or {})
        self.priority = tuple(priority)
        self.configured = True
        self.eager = frozenset(itertools.islice(self.specs, EAGER_KEYS))
        self._blocks.clear()

    def changed_by(
        self,
        specs: Mapping[str, LimitSpec],
        defaults: Mapping[str, LimitSpec] | None,
        priority: Sequence[str],
        seen: Iterable[str],
    ) -> list[str]:
        """Keys (configured before or now, or `seen`) whose shares a new config changes: every one when the
        class order changes, else those whose spec (their own or their prefix default) differs. Only these
        have buckets to store at the old capacities and resize, so a reload that touches a few of 10^5
        tenants costs a few keys' worth of Redis calls."""
        new = Keyspace()
        new.configure(specs, defaults, priority)
        keys = dict.fromkeys(itertools.chain(self.specs, specs, seen))
        if new.priority != self.priority:
            return list(keys)
        return [key for key in keys if self.spec(key) != new.spec(key)]

    # -- scales --------------------------------------------------------------------------------------------

    def effective_scale(self, key: str) -> float:
        """The key's scale as last stored in Redis (what this replica's last call on it was judged at)."""
        return self._scales.get(key, 1.0)

    def adopt_scales(self, keys: Sequence[str], scales: Sequence[float]) -> None:
        for key, scale in zip(keys, scales, strict=True):
            if self._scales.get(key, 1.0) != scale:
                if scale == 1.0:
                    self._scales.pop(key, None)
                else:
                    self._scales[key] = scale
                self._blocks.pop(key, None)

    def forget_scales(self) -> None:
        """Redis lost the stored scales: start again from 1, as Redis now does."""
        self._scales.clear()
        self._blocks.clear()

    # -- script arguments ----------------------------------------------------------------------------------

    def spec(self, key: str) -> tuple[LimitSpec, bool]:
        spec = self.specs.get(key)
        if spec is not None:
            return spec, True
        for prefix, default in self.defaults.items():
            if key.startswith(prefix):
                return default, False
        return LimitSpec(), False

    def template(self, key: str) -> KeyState:
        """The key's configured shares with their effective capacities, nothing counted yet."""
        spec, configured = self.spec(key)
        state = KeyState(
            spec=spec, priority=self.priority, scale=self.effective_scale(key), configured=configured
        )
        state.rebuild(0.0)
        return state

    def keyspec(self, keys: Sequence[str]) -> list[str]:
        """The KEYSPEC argument block of the scripts (see `scripts`)."""
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
        state = self.template(key)
        out = [key, repr(state.scale), "1" if state.spec.tokens_per_minute is not None else "0"]
        out.append(str(len(state.shares)))
        for name, share in state.shares.items():
            out += [
                name,
                _num(share.concurrency),
                _num(share.tokens_per_minute),
                repr(state.base_tokens(name)),
            ]
        return out

    # -- replies -------------------------------------------------------------------------------------------

    def parse_states(
        self, keys: Sequence[str], raw: list[Any], now: float, scales: Sequence[float], with_places: bool
    ) -> tuple[list[tuple[str, str]], list[KeyState]]:
        """Rebuild each key's state as the limiter would hold it, from a script's reply."""
        places: list[tuple[str, str]] = []
        views: list[KeyState] = []
        i = 0
        for key, scale in zip(keys, scales, strict=True):
            if with_places:
                places.append((str(raw[i]), str(raw[i + 1])))
                i += 2
            hold = float(raw[i]) if raw[i] != "" else None
            count = int(raw[i + 1])
            i += 2
            shares: list[ShareReading] = []
            for _ in range(count):
                shares.append((str(raw[i]), int(raw[i + 1]), float(raw[i + 2]) if raw[i + 2] != "" else None))
                i += 3
            views.append(self.view(key, shares, hold, now, scale))
        return places, views

    def view(
        self, key: str, shares: list[ShareReading], hold: float | None, now: float, scale: float
    ) -> KeyState:
        spec, configured = self.spec(key)
        state = KeyState(spec=spec, priority=self.priority, scale=scale, configured=configured)
        for name, active, _ in shares:
            state.shares[name] = Share(active=active)
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


def _num(value: float | None) -> str:
    return "" if value is None else repr(float(value))


def refusal(
    code: int,
    key: str,
    view: KeyState,
    status: RateLimitStatus,
    holder: str | None,
    tokens: int,
    now: float,
    use_pool: bool,
) -> Rejection:
    """The acquire script's refusal `code` on `key` (1: no slot, 3: larger than the key's capacity, else no
    tokens), its retry hint from the state it was judged on: a refused request took nothing."""
    if code == 1:
        return Rejection(Reason.CONCURRENCY, key, view.slot_retry_after(holder), status)
    if code == 3:
        return Rejection(Reason.TOO_LARGE, key, None, status)
    _, retry = view.place_tokens(holder, tokens, now, use_pool)
    return Rejection(token_reason(key), key, retry, status)
