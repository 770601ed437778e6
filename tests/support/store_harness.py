"""One test body, every store: the in-process store on a fake clock and the Redis store (one server or a
Cluster) on real time. The limiter's behaviour cases (tests/support/limiter_cases.py) and the store suites
under tests/component/store take a `Harness`."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pytest

from extproc.core.clock import FakeClock
from extproc.core.limiter.limiter import KeySnapshot, Lease, LimitSpec, Rejection
from extproc.core.ports import LimiterStore
from extproc.store.local import LocalStore

REAL_TIME_SLACK_S = 0.5
"""How much real time a Redis-backed test may spend between two steps that a fake clock would not see."""


@dataclass
class Harness:
    """A store and, for the in-process one, the fake clock it reads: `advance` moves that clock or, for a
    store on real time, sleeps; `tokens` and `seconds` compare with the slack real time needs (none on a
    fake clock)."""

    store: LimiterStore
    clock: FakeClock | None = None

    @property
    def real_time(self) -> bool:
        return self.clock is None

    async def advance(self, seconds: float) -> None:
        if self.clock is not None:
            self.clock.advance(seconds)
        else:
            await asyncio.sleep(seconds)

    async def apply(
        self,
        specs: Mapping[str, LimitSpec],
        defaults: Mapping[str, LimitSpec] | None = None,
        priority: Sequence[str] = (),
    ) -> None:
        await self.store.apply_limits(specs, defaults, priority)

    async def acquire(
        self,
        keys: Sequence[str],
        tokens: int,
        holder: str | None = None,
        use_pool: bool = True,
        output_tokens: int = 0,
    ) -> Lease | Rejection:
        return await self.store.acquire(keys, tokens, holder, use_pool, output_tokens)

    async def lease(
        self,
        keys: Sequence[str],
        tokens: int,
        holder: str | None = None,
        use_pool: bool = True,
        output_tokens: int = 0,
    ) -> Lease:
        result = await self.acquire(keys, tokens, holder, use_pool, output_tokens)
        assert isinstance(result, Lease), result
        return result

    def snap(self, key: str) -> KeySnapshot:
        found = [s for s in self.store.snapshot() if s.key == key]
        assert found, f"no snapshot of {key}"
        return found[0]

    def shares(self, key: str) -> dict[str, Any]:
        return {s.name: s for s in self.snap(key).shares}

    def tokens(self, value: float, tokens_per_minute: float) -> Any:
        """`value` tokens, give or take what a bucket refills while real time passes."""
        slack = tokens_per_minute / 60 * REAL_TIME_SLACK_S if self.real_time else 1e-6
        return pytest.approx(value, abs=slack)

    def seconds(self, value: float, abs_s: float = 0.05) -> Any:
        return pytest.approx(value, abs=abs_s if self.real_time else 1e-6)


def local_harness() -> Harness:
    """The in-process store (a `JointLimiter`) on a fake clock."""
    clock = FakeClock()
    return Harness(LocalStore(clock=clock), clock)
