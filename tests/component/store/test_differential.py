"""Random operation sequences applied to both stores side by side must get the same answers.

The Redis store runs on Redis server time, the in-process store on a fake clock that is set to the server
time of each Redis call before the same call is made on it: both judge every step at the same instant, so
their answers must agree exactly (up to float rounding), however long the machine takes between the calls.
Snapshots are compared after a refresh of the Redis store's view, at that refresh's server time.
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator

import pytest

from extproc.core.clock import FakeClock
from extproc.core.limiter.limiter import Lease, LimitSpec, Rejection
from extproc.core.limiter.split import SplitIndex, expand
from extproc.store.local import LocalStore
from extproc.store.redis import RedisStore

PRIORITY = ("critical", "standard", "batch")
HOLDERS = [None, "critical", "standard", "batch"]
KEYS = ["global", "model:a", "tenant:t"]

CONFIG_A = {
    "global": LimitSpec(max_concurrency=6, tokens_per_minute=1800),
    "model:a": LimitSpec(
        max_concurrency=4,
        tokens_per_minute=1200,
        input_tokens_per_minute=900,
        output_tokens_per_minute=450,
        guaranteed=(
            ("critical", LimitSpec(max_concurrency=2, tokens_per_minute=600)),
            ("batch", LimitSpec(max_concurrency=1)),
        ),
    ),
}
CONFIG_B = {
    "global": LimitSpec(max_concurrency=3, tokens_per_minute=1200),
    "model:a": LimitSpec(
        max_concurrency=5,
        guaranteed=(("critical", LimitSpec(max_concurrency=1)), ("batch", LimitSpec(max_concurrency=1))),
    ),
}
DEFAULTS_A = {"tenant:": LimitSpec(max_concurrency=2, output_tokens_per_minute=600)}
DEFAULTS_B = {"tenant:": LimitSpec(max_concurrency=1, tokens_per_minute=300)}
"""CONFIG_A and DEFAULTS_A carry split input/output limits (core/limiter/split.py): the derived keys are named
and charged alike by both stores, and drop back to unlimited under CONFIG_B."""


def tables(
    config: dict[str, LimitSpec], defaults: dict[str, LimitSpec]
) -> tuple[dict[str, LimitSpec], dict[str, LimitSpec]]:
    """The stores' spec tables, the derived keys of split limits included, as the sidecar applies them."""
    return expand(config, defaults)


SPLIT_KEYS = SplitIndex.of(CONFIG_A, DEFAULTS_A)


@pytest.fixture
async def redis_store(redis_url: str) -> AsyncIterator[RedisStore]:
    store = RedisStore.from_url(redis_url, timeout_s=1.0)
    await store.start()
    yield store
    await store.close()


TOKENS_ABS = 1e-3
"""Token levels judged at the same instant differ only by float rounding (Lua and Python order the refill
arithmetic differently)."""


class MatchedClock(FakeClock):
    """A fake clock moved to the Redis server time of the Redis store's last call."""

    def __init__(self, remote: RedisStore) -> None:
        super().__init__(0.0)
        self.remote = remote

    def match(self) -> None:
        assert self.remote.server_time >= self.now, "Redis server time went back"
        self.now = self.remote.server_time


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
async def test_random_sequences_get_the_same_answers(redis_store: RedisStore, seed: int) -> None:
    rng = random.Random(seed)
    remote = redis_store
    clock = MatchedClock(remote)
    local = LocalStore(clock=clock)
    await remote.apply_limits(*tables(CONFIG_A, DEFAULTS_A), PRIORITY)
    clock.match()
    await local.apply_limits(*tables(CONFIG_A, DEFAULTS_A), PRIORITY)
    open_pairs: list[tuple[Lease, Lease]] = []
    for step in range(250):
        op = rng.random()
        where = f"seed {seed} step {step}"
        if op < 0.45:
            keys = SPLIT_KEYS.keys_for([k for k in KEYS if k == "global" or rng.random() < 0.6])
            tokens = 50 * (rng.randint(0, 4) if rng.random() < 0.8 else rng.randint(5, 40))
            output = rng.randint(0, tokens)
            holder, use_pool = rng.choice(HOLDERS), rng.random() < 0.8
            b = await remote.acquire(keys, tokens, holder, use_pool, output)
            clock.match()
            a = await local.acquire(keys, tokens, holder, use_pool, output)
            assert type(a) is type(b), (where, a, b)
            if isinstance(a, Rejection) and isinstance(b, Rejection):
                assert (a.reason, a.key) == (b.reason, b.key), (where, a, b)
                if a.retry_after_s is None or b.retry_after_s is None:
                    assert a.retry_after_s == b.retry_after_s, where
                else:
                    assert b.retry_after_s == pytest.approx(a.retry_after_s, abs=1e-6), (where, a, b)
            else:
                assert isinstance(a, Lease) and isinstance(b, Lease)
                assert a.placements == b.placements, (where, a, b)
                open_pairs.append((a, b))
            sa, sb = a.status, b.status
            assert (sa.limit_requests, sa.remaining_requests) == (sb.limit_requests, sb.remaining_requests), (
                where
            )
            assert sa.limit_tokens == sb.limit_tokens, where
            if sa.remaining_tokens is not None and sb.remaining_tokens is not None:
                # Whole tokens of levels equal up to rounding: a level at an integer may floor either way.
                assert abs(sa.remaining_tokens - sb.remaining_tokens) <= 1, (where, sa, sb)
        elif op < 0.5 and open_pairs:  # a bound admission's correction: prompt tokens back
            la, lb = open_pairs[rng.randrange(len(open_pairs))]
            back = rng.randint(1, 100)
            refunded = await remote.refund(lb, back)
            clock.match()
            assert await local.refund(la, back) == refunded, where
            assert (la.reserved_tokens, la.reserved_output) == (lb.reserved_tokens, lb.reserved_output), where
        elif op < 0.85 and open_pairs:
            la, lb = open_pairs.pop(rng.randrange(len(open_pairs)))
            actual = 50 * (rng.randint(0, 3) if rng.random() < 0.9 else rng.randint(4, 16))
            output = rng.randint(0, actual)
            assert await remote.release(lb, actual, output) is True
            clock.match()
            assert await local.release(la, actual, output) is True
        elif op < 0.93:
            config, defaults = rng.choice([(CONFIG_A, DEFAULTS_A), (CONFIG_B, DEFAULTS_B)])
            await remote.apply_limits(*tables(config, defaults), PRIORITY)
            clock.match()  # the last of its calls: the one that resized the buckets
            await local.apply_limits(*tables(config, defaults), PRIORITY)
        else:
            scale = rng.choice([1.0, 0.5])
            await remote.set_scale("model:a", scale)
            clock.match()
            await local.set_scale("model:a", scale)
        await remote.refresh()
        clock.match()
        compare_snapshots(local, remote, where)


def compare_snapshots(local: LocalStore, remote: RedisStore, where: str) -> None:
    mine = {s.key: s for s in local.snapshot()}
    for theirs in remote.snapshot():
        ours = mine[theirs.key]
        assert ours.active == theirs.active, (where, ours, theirs)
        assert ours.effective_concurrency == theirs.effective_concurrency, (where, ours, theirs)
        assert ours.effective_tokens_per_minute == theirs.effective_tokens_per_minute, (where, ours, theirs)
        assert {s.name: s.active for s in ours.shares} == {s.name: s.active for s in theirs.shares}, where
        if ours.tokens_available is None or theirs.tokens_available is None:
            assert ours.tokens_available == theirs.tokens_available, (where, ours, theirs)
        else:
            assert abs(ours.tokens_available - theirs.tokens_available) <= TOKENS_ABS, (where, ours, theirs)
