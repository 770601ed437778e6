"""The limiter's behaviour cases, written once over a `Harness` and run for every store: the in-process
store on a fake clock by tests/unit/core/limiter/ (test_limiter.py, test_shares.py), one Redis and a Redis
Cluster on real time by tests/component/store/test_parity.py. Rates are chosen for short waits, and token
amounts and waits are compared with the slack real time refills
(`h.tokens`, `h.seconds`; exact on a fake clock).

A case is an `async def` taking the harness; `limiter_case` and `share_case` register it under its name,
the id its parametrized tests carry."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import pytest

from extproc.core.limiter.limiter import Lease, LimitSpec, Reason, Rejection
from extproc.core.limiter.shares import SHARED
from extproc.core.limiter.split import expand
from tests.support.store_harness import Harness

Case = Callable[[Harness], Awaitable[None]]

LIMITER_CASES: list[Case] = []
"""Keys, slots, buckets, settlement, scale and status (tests/unit/core/limiter/test_limiter.py)."""

SHARE_CASES: list[Case] = []
"""Guarantees, the shared pool and pressure (the unit cases of tests/unit/core/limiter/test_shares.py)."""


def limiter_case(case: Case) -> Case:
    LIMITER_CASES.append(case)
    return case


def share_case(case: Case) -> Case:
    SHARE_CASES.append(case)
    return case


def case_id(case: Case) -> str:
    """A case's test id: its function's name."""
    return getattr(case, "__name__", repr(case))


PRIORITY = ("critical", "standard", "batch")

POOL = LimitSpec(
    max_concurrency=10,
    tokens_per_minute=6000,
    guaranteed=(
        ("critical", LimitSpec(max_concurrency=4, tokens_per_minute=2400)),
        ("batch", LimitSpec(max_concurrency=1)),
    ),
)


# -- keys, slots and buckets -------------------------------------------------------------------------------


@limiter_case
async def concurrency_limit_admits_exactly_the_limit(h: Harness) -> None:
    await h.apply({"global": LimitSpec(max_concurrency=3)})
    results = [await h.acquire(["global"], 0) for _ in range(5)]
    rejections = [r for r in results if isinstance(r, Rejection)]
    assert sum(isinstance(r, Lease) for r in results) == 3
    assert len(rejections) == 2
    assert all(r.reason is Reason.CONCURRENCY and r.key == "global" for r in rejections)
    assert rejections[0].status.remaining_requests == 0
    assert rejections[0].status.limit_requests == 3
    assert h.snap("global").active == 3


@limiter_case
async def token_rejection_gives_the_slot_back(h: Harness) -> None:
    await h.apply({"m": LimitSpec(max_concurrency=2, tokens_per_minute=600)})
    await h.lease(["m"], 500)
    rej = await h.acquire(["m"], 500)
    assert isinstance(rej, Rejection) and rej.reason is Reason.TOKENS
    assert rej.retry_after_s == h.seconds(40.0)  # 400 missing at 10/s
    assert h.snap("m").active == 1


@limiter_case
async def admitted_again_after_refill(h: Harness) -> None:
    await h.apply({"m": LimitSpec(tokens_per_minute=6000)})  # 100 tokens/s
    await h.lease(["m"], 6000)
    rej = await h.acquire(["m"], 30)
    assert isinstance(rej, Rejection) and rej.retry_after_s == h.seconds(0.3)
    await h.advance(0.15)
    assert isinstance(await h.acquire(["m"], 30), Rejection)
    await h.advance(0.2)
    assert isinstance(await h.acquire(["m"], 30), Lease)


@limiter_case
async def request_larger_than_capacity_is_refused_with_no_retry(h: Harness) -> None:
    await h.apply({"m": LimitSpec(tokens_per_minute=600)})
    rej = await h.acquire(["m"], 601)
    assert isinstance(rej, Rejection)
    assert rej.reason is Reason.TOO_LARGE and rej.retry_after_s is None


@limiter_case
async def all_or_nothing_across_keys(h: Harness) -> None:
    await h.apply(
        {
            "global": LimitSpec(max_concurrency=10, tokens_per_minute=10_000),
            "tenant:a": LimitSpec(max_concurrency=1),
        }
    )
    await h.lease(["global", "tenant:a"], 100)
    rej = await h.acquire(["global", "tenant:a"], 100)
    assert isinstance(rej, Rejection) and rej.key == "tenant:a"
    g = h.snap("global")
    assert g.active == 1
    assert g.tokens_available == h.tokens(9_900, 10_000)


@limiter_case
async def all_or_nothing_when_a_later_key_lacks_tokens(h: Harness) -> None:
    await h.apply(
        {"global": LimitSpec(max_concurrency=5, tokens_per_minute=6000), "m": LimitSpec(tokens_per_minute=60)}
    )
    rej = await h.acquire(["global", "m"], 100)
    assert isinstance(rej, Rejection) and rej.reason is Reason.TOO_LARGE and rej.key == "m"
    await h.lease(["global", "m"], 50)
    rej = await h.acquire(["global", "m"], 50)
    assert isinstance(rej, Rejection) and rej.reason is Reason.TOKENS and rej.key == "m"
    assert h.snap("global").active == 1
    assert h.snap("global").tokens_available == h.tokens(5950, 6000)


@limiter_case
async def settle_exactly_once_refunds_and_releases(h: Harness) -> None:
    await h.apply({"m": LimitSpec(max_concurrency=1, tokens_per_minute=6000)})
    lease = await h.lease(["m"], 1000)
    assert await h.store.release(lease, 300) is True
    assert await h.store.release(lease, 300) is False
    assert await h.store.release(lease, 0) is False
    snap = h.snap("m")
    assert snap.active == 0
    assert snap.tokens_available == h.tokens(5700, 6000)  # 6000 - 300 actually used
    assert lease.actual_tokens == 300 and lease.settled


@limiter_case
async def refunds_are_capped_at_capacity(h: Harness) -> None:
    await h.apply({"m": LimitSpec(tokens_per_minute=600)})
    lease = await h.lease(["m"], 100)
    await h.advance(0.1)
    assert await h.store.release(lease, 0)
    assert h.snap("m").tokens_available == pytest.approx(600)


@limiter_case
async def overrun_charged_as_debt(h: Harness) -> None:
    await h.apply({"m": LimitSpec(tokens_per_minute=600)})
    lease = await h.lease(["m"], 600)
    await h.store.release(lease, 700)
    assert h.snap("m").tokens_available == h.tokens(-100, 600)
    rej = await h.acquire(["m"], 50)
    assert isinstance(rej, Rejection) and rej.retry_after_s == h.seconds(15.0, abs_s=0.6)


# -- slots given back before the settlement (`LimiterStore.release_slot`) ---------------------------------


@limiter_case
async def a_slot_given_back_admits_another_while_the_tokens_wait_for_the_release(h: Harness) -> None:
    await h.apply({"m": LimitSpec(max_concurrency=1, tokens_per_minute=6000)})
    lease = await h.lease(["m"], 3000)
    assert isinstance(await h.acquire(["m"], 0), Rejection)
    assert await h.store.release_slot(lease) is True
    assert lease.slot_released and not lease.settled
    snap = h.snap("m")
    assert snap.active == 0
    assert snap.tokens_available == h.tokens(3000, 6000)  # still reserved
    second = await h.lease(["m"], 0)  # the slot it gave back
    assert isinstance(await h.acquire(["m"], 0), Rejection)  # one slot, held once
    assert await h.store.release(lease, 1000) is True  # tokens only: no slot freed twice
    assert h.snap("m").active == 1
    assert isinstance(await h.acquire(["m"], 0), Rejection)
    assert h.snap("m").tokens_available == h.tokens(5000, 6000)  # settled to what was used
    assert await h.store.release(second, 0)
    assert h.snap("m").active == 0


@limiter_case
async def a_slot_is_given_back_once_and_never_by_a_settled_lease(h: Harness) -> None:
    await h.apply({"m": LimitSpec(max_concurrency=2, tokens_per_minute=600)}, priority=PRIORITY)
    lease = await h.lease(["m"], 100, "critical")
    other = await h.lease(["m"], 0)
    assert await h.store.release_slot(lease)
    assert await h.store.release_slot(lease) is False
    assert h.snap("m").active == 1
    assert await h.store.release(lease, 100)
    assert await h.store.release(lease, 100) is False
    assert h.snap("m").active == 1  # `other` still holds its slot
    settled = await h.lease(["m"], 0)
    assert await h.store.release(settled, 0)
    assert await h.store.release_slot(settled) is False
    assert h.snap("m").active == 1
    assert await h.store.release(other, 0)
    snap = h.snap("m")
    assert snap.active == 0 and snap.tokens_available == h.tokens(500, 600)


@limiter_case
async def a_slot_given_back_on_several_keys_frees_each_once(h: Harness) -> None:
    await h.apply(
        {
            "global": LimitSpec(max_concurrency=3, tokens_per_minute=6000),
            "model:m": LimitSpec(max_concurrency=1),
        }
    )
    lease = await h.lease(["global", "model:m"], 600)
    assert await h.store.release_slot(lease)
    assert (h.snap("global").active, h.snap("model:m").active) == (0, 0)
    other = await h.lease(["global", "model:m"], 0)
    assert await h.store.release(lease, 60)
    assert (h.snap("global").active, h.snap("model:m").active) == (1, 1)
    assert h.snap("global").tokens_available == h.tokens(5940, 6000)
    assert await h.store.release(other, 0)


# -- split input/output limits (extproc/core/limiter/split.py) ----------------------------------------------

SPLIT = LimitSpec(tokens_per_minute=6000, input_tokens_per_minute=600, output_tokens_per_minute=300)
SPLIT_KEYS = ["model:m", "input:model:m", "output:model:m"]


@limiter_case
async def split_limits_refuse_by_their_own_bucket_and_wait(h: Harness) -> None:
    """The prompt goes to the input bucket, the reserved completion to the output one; a refusal names the
    bucket that cannot hold its part, with that bucket's refill wait."""
    await h.apply(*expand({"model:m": SPLIT}, {}))
    await h.lease(SPLIT_KEYS, 500, output_tokens=200)  # input 600 - 300, output 300 - 200
    assert h.snap("input:model:m").tokens_available == h.tokens(300, 600)
    assert h.snap("output:model:m").tokens_available == h.tokens(100, 300)
    assert h.snap("model:m").tokens_available == h.tokens(5500, 6000)
    rej = await h.acquire(SPLIT_KEYS, 500, output_tokens=100)  # a 400-token prompt: 100 missing at 10/s
    assert isinstance(rej, Rejection) and (rej.reason, rej.key) == (Reason.INPUT_TOKENS, "input:model:m")
    assert rej.retry_after_s == h.seconds(10.0)
    rej = await h.acquire(SPLIT_KEYS, 300, output_tokens=250)  # 150 output missing at 5/s
    assert isinstance(rej, Rejection) and (rej.reason, rej.key) == (Reason.OUTPUT_TOKENS, "output:model:m")
    assert rej.retry_after_s == h.seconds(30.0)
    assert h.snap("model:m").active == 1  # the refusals took nothing
    assert rej.status.limit_tokens == 300  # the headers report the tightest bucket: the output one


@limiter_case
async def split_limits_settle_each_bucket_to_its_part(h: Harness) -> None:
    await h.apply(*expand({"model:m": SPLIT}, {}))
    lease = await h.lease(SPLIT_KEYS, 500, output_tokens=200)
    assert await h.store.refund(lease, 50) is True  # a bound corrected: prompt tokens back, not output
    assert (lease.reserved_tokens, lease.reserved_output) == (450, 200)
    # A refund returns no state: read the buckets (a store's snapshot is as of its last reply).
    assert (await h.store.status(["input:model:m"])).remaining_tokens == h.tokens(350, 600)
    assert (await h.store.status(["output:model:m"])).remaining_tokens == h.tokens(100, 300)
    assert await h.store.release(lease, 290, 40) is True  # a 250-token prompt, 40 generated
    assert h.snap("input:model:m").tokens_available == h.tokens(350, 600)
    assert h.snap("output:model:m").tokens_available == h.tokens(260, 300)
    assert h.snap("model:m").tokens_available == h.tokens(5710, 6000)


@limiter_case
async def a_prompt_larger_than_the_input_limit_never_fits(h: Harness) -> None:
    await h.apply(*expand({"model:m": SPLIT}, {}))
    rej = await h.acquire(SPLIT_KEYS, 700, output_tokens=50)
    assert isinstance(rej, Rejection) and (rej.reason, rej.key) == (Reason.TOO_LARGE, "input:model:m")
    assert rej.retry_after_s is None


@limiter_case
async def a_split_default_applies_to_unconfigured_keys_only(h: Harness) -> None:
    specs, defaults = expand(
        {"tenant:plain": LimitSpec(max_concurrency=5)}, {"tenant:": LimitSpec(output_tokens_per_minute=60)}
    )
    await h.apply(specs, defaults)
    rej = await h.acquire(["tenant:a", "input:tenant:a", "output:tenant:a"], 100, output_tokens=80)
    assert isinstance(rej, Rejection) and (rej.reason, rej.key) == (Reason.TOO_LARGE, "output:tenant:a")
    await h.lease(["tenant:plain", "input:tenant:plain", "output:tenant:plain"], 100, output_tokens=80)


@limiter_case
async def lowered_limit_keeps_inflight_and_admits_nothing_until_below(h: Harness) -> None:
    await h.apply({"m": LimitSpec(max_concurrency=4)})
    leases = [await h.lease(["m"], 0) for _ in range(4)]
    await h.apply({"m": LimitSpec(max_concurrency=2)})
    assert h.snap("m").active == 4
    for lease in leases[:2]:
        await h.store.release(lease, 0)
    assert isinstance(await h.acquire(["m"], 0), Rejection)  # active 2, limit 2
    await h.store.release(leases[2], 0)
    assert isinstance(await h.acquire(["m"], 0), Lease)


@limiter_case
async def scale_shrinks_effective_limits_and_recovers(h: Harness) -> None:
    await h.apply({"m": LimitSpec(max_concurrency=10, tokens_per_minute=1000)})
    await h.store.set_scale("m", 0.6)
    snap = h.snap("m")
    assert snap.effective_concurrency == 6
    assert snap.effective_tokens_per_minute == 600
    assert snap.tokens_available == pytest.approx(600)
    assert snap.scale == 0.6
    leases = [await h.acquire(["m"], 0) for _ in range(7)]
    assert sum(isinstance(x, Lease) for x in leases) == 6
    await h.store.set_scale("m", 1.0)
    assert h.snap("m").effective_concurrency == 10
    assert isinstance(await h.acquire(["m"], 0), Lease)
    with pytest.raises(ValueError):
        await h.store.set_scale("m", 0)


@limiter_case
async def a_bucket_filled_while_blind_keeps_its_tokens_when_the_scale_recovers(h: Harness) -> None:
    """Why `x-ratelimit-remaining-tokens` reads 60 % of the limit right after a start (docs/configuration.md,
    `limits`): a model key first used before its pool's first KV sample is built at the stale scale
    (`min_scale`, 0.6), its bucket full at 60 %; the scale then recovers and the limits with it, but a bucket
    only refills at its rate, so the tokens reach the full limit after (1 - 0.6) x 60 s = 24 s."""
    await h.apply({"m": LimitSpec(max_concurrency=10, tokens_per_minute=1000)})
    await h.store.set_scale("m", 0.6)
    status = await h.store.status(["m"])
    assert (status.limit_requests, status.limit_tokens) == (6, 600)
    assert status.remaining_tokens == h.tokens(600, 1000)
    await h.store.set_scale("m", 1.0)
    status = await h.store.status(["m"])
    assert (status.limit_requests, status.remaining_requests, status.limit_tokens) == (10, 10, 1000)
    assert status.remaining_tokens == h.tokens(600, 1000)
    assert status.reset_tokens_s == h.seconds(24.0, abs_s=1.0)


@limiter_case
async def removed_key_keeps_its_leases_and_becomes_unlimited(h: Harness) -> None:
    await h.apply({"m": LimitSpec(max_concurrency=1)})
    lease = await h.lease(["m"], 0)
    await h.apply({})
    assert isinstance(await h.acquire(["m"], 0), Lease)
    assert await h.store.release(lease, 0)
    assert h.snap("m").active == 1


@limiter_case
async def defaults_by_prefix(h: Harness) -> None:
    await h.apply({}, defaults={"tenant:": LimitSpec(max_concurrency=1, tokens_per_minute=600)})
    await h.lease(["tenant:x"], 60)
    rej = await h.acquire(["tenant:x"], 0)
    assert isinstance(rej, Rejection) and rej.reason is Reason.CONCURRENCY
    assert isinstance(await h.acquire(["tenant:y"], 0), Lease)
    assert h.snap("tenant:x").max_concurrency == 1


@limiter_case
async def slot_retry_hint_follows_hold_times(h: Harness) -> None:
    await h.apply({"m": LimitSpec(max_concurrency=2)})
    for _ in range(4):
        lease = await h.lease(["m"], 0)
        await h.advance(0.2)
        await h.store.release(lease, 0)
    await h.lease(["m"], 0)
    await h.lease(["m"], 0)
    rej = await h.acquire(["m"], 0)
    assert isinstance(rej, Rejection)
    assert rej.retry_after_s == h.seconds(0.1, abs_s=0.03)  # 0.2 s holds over 2 slots


@limiter_case
async def status_reports_tightest_key(h: Harness) -> None:
    await h.apply(
        {"global": LimitSpec(max_concurrency=10, tokens_per_minute=1000), "m": LimitSpec(max_concurrency=2)}
    )
    lease = await h.lease(["global", "m"], 400)
    s = lease.status
    assert (s.limit_requests, s.remaining_requests) == (2, 1)
    assert (s.limit_tokens, s.remaining_tokens) == (1000, 600)
    assert s.reset_tokens_s == h.seconds(24.0)
    s = await h.store.status(["global", "m"])
    assert (s.limit_requests, s.remaining_requests) == (2, 1)
    assert s.remaining_tokens in (600, 601, 602, 603, 604, 605)


@limiter_case
async def a_request_sees_the_old_limits_or_the_new_ones_never_a_mix(h: Harness) -> None:
    await h.apply({"global": LimitSpec(max_concurrency=3), "tenant:a": LimitSpec(max_concurrency=2)})
    for _ in range(2):
        await h.lease(["global", "tenant:a"], 0)
    await h.apply({"global": LimitSpec(max_concurrency=10), "tenant:a": LimitSpec(max_concurrency=1)})
    refused = await h.acquire(["global", "tenant:a"], 0)  # new global room, but the tenant's new limit
    assert isinstance(refused, Rejection) and refused.key == "tenant:a"
    assert refused.status.limit_requests == 1


# -- guarantees and the pool ------------------------------------------------------------------------------


@share_case
async def batch_flood_cannot_take_critical_guarantee(h: Harness) -> None:
    await h.apply({"model:m": POOL}, priority=PRIORITY)
    batch = [await h.acquire(["model:m"], 10, "batch") for _ in range(20)]
    assert sum(isinstance(b, Lease) for b in batch) == 6  # its own 1 + the pool of 5
    critical = [await h.acquire(["model:m"], 10, "critical") for _ in range(4)]
    assert all(isinstance(c, Lease) for c in critical)
    assert isinstance(await h.acquire(["model:m"], 10, "critical"), Rejection)


@share_case
async def borrow_and_give_back_to_the_same_share(h: Harness) -> None:
    await h.apply({"model:m": POOL}, priority=PRIORITY)
    leases = [await h.lease(["model:m"], 100, "critical") for _ in range(6)]
    assert [lease.placements[0].slot for lease in leases] == ["critical"] * 4 + [SHARED] * 2
    shares = h.shares("model:m")
    assert shares["critical"].active == 4 and shares[SHARED].active == 2
    assert shares["critical"].tokens_available == h.tokens(2400 - 600, 2400)
    assert shares[SHARED].tokens_available == pytest.approx(3600)
    lease = leases[5]
    assert (lease.placements[0].slot, lease.placements[0].tokens) == (SHARED, "critical")
    await h.store.release(lease, 50)
    shares = h.shares("model:m")
    assert shares[SHARED].active == 1
    assert shares["critical"].tokens_available == h.tokens(1800 + 50, 2400)
    big = [await h.acquire(["model:m"], 1000, "critical") for _ in range(3)]
    assert [b.placements[0].tokens for b in big if isinstance(b, Lease)] == ["critical", SHARED, SHARED]


@share_case
async def unguaranteed_class_uses_only_the_pool(h: Harness) -> None:
    await h.apply({"model:m": POOL}, priority=PRIORITY)
    results = [await h.acquire(["model:m"], 0, "standard") for _ in range(7)]
    assert sum(isinstance(r, Lease) for r in results) == 5
    rej = results[-1]
    assert isinstance(rej, Rejection) and rej.reason is Reason.CONCURRENCY
    assert rej.status.limit_requests == 5 and rej.status.remaining_requests == 0


@share_case
async def status_reports_guarantee_plus_pool_for_the_holder(h: Harness) -> None:
    await h.apply({"model:m": POOL}, priority=PRIORITY)
    status = await h.store.status(["model:m"], "critical")
    assert (status.limit_requests, status.remaining_requests) == (9, 9)
    assert (status.limit_tokens, status.remaining_tokens) == (6000, 6000)
    assert (await h.store.status(["model:m"], "standard")).limit_requests == 5


@share_case
async def pressure_takes_the_pool_then_batch_and_keeps_critical(h: Harness) -> None:
    await h.apply({"model:m": POOL}, priority=PRIORITY)
    await h.store.set_scale("model:m", 0.5)  # 5 slots: pool (5) gone, batch 1 and critical 4 kept
    assert isinstance(await h.acquire(["model:m"], 0, "standard"), Rejection)
    assert isinstance(await h.acquire(["model:m"], 0, "batch"), Lease)
    assert isinstance(await h.acquire(["model:m"], 0, "batch"), Rejection)
    await h.store.set_scale("model:m", 0.4)  # 4 slots: batch's guarantee cut, critical intact
    snap = h.shares("model:m")
    assert snap["batch"].effective_concurrency == 0 and snap["batch"].active == 1  # in-flight kept
    assert snap["critical"].effective_concurrency == 4
    assert all([isinstance(await h.acquire(["model:m"], 0, "critical"), Lease) for _ in range(4)])


@share_case
async def token_request_too_large_for_shrunk_pool_is_retryable_but_not_for_base(h: Harness) -> None:
    await h.apply({"model:m": LimitSpec(tokens_per_minute=1000)}, priority=PRIORITY)
    await h.store.set_scale("model:m", 0.6)
    rej = await h.acquire(["model:m"], 800, None)
    assert isinstance(rej, Rejection) and rej.reason is Reason.TOKENS and rej.retry_after_s == 30.0
    rej = await h.acquire(["model:m"], 1001, None)
    assert isinstance(rej, Rejection) and rej.reason is Reason.TOO_LARGE and rej.retry_after_s is None


@share_case
async def removed_guarantee_keeps_its_leases_until_they_end(h: Harness) -> None:
    await h.apply({"model:m": POOL}, priority=PRIORITY)
    lease = await h.lease(["model:m"], 0, "critical")
    await h.apply({"model:m": LimitSpec(max_concurrency=10)}, priority=PRIORITY)
    assert "critical" in h.shares("model:m")
    assert h.snap("model:m").active == 1
    await h.store.release(lease, 0)
    assert set(h.shares("model:m")) == {SHARED}


@share_case
async def removing_or_lowering_a_guarantee_never_puts_more_in_flight_than_the_total(h: Harness) -> None:
    spec = LimitSpec(max_concurrency=4, guaranteed=(("critical", LimitSpec(max_concurrency=2)),))
    await h.apply({"model:m": spec}, priority=PRIORITY)
    for _ in range(2):
        await h.lease(["model:m"], 0, "critical")
    await h.apply({"model:m": LimitSpec(max_concurrency=4)}, priority=PRIORITY)  # guarantee removed
    more = [await h.acquire(["model:m"], 0, "standard") for _ in range(4)]
    assert sum(isinstance(x, Lease) for x in more) == 2
    assert h.snap("model:m").active == 4
    spec = LimitSpec(max_concurrency=4, guaranteed=(("critical", LimitSpec(max_concurrency=3)),))
    await h.apply({"model:n": spec}, priority=PRIORITY)
    for _ in range(3):
        await h.lease(["model:n"], 0, "critical")
    lowered = LimitSpec(max_concurrency=4, guaranteed=(("critical", LimitSpec(max_concurrency=1)),))
    await h.apply({"model:n": lowered}, priority=PRIORITY)
    more = [await h.acquire(["model:n"], 0, "standard") for _ in range(4)]
    assert sum(isinstance(x, Lease) for x in more) == 1
    assert h.snap("model:n").active == 4


@share_case
async def a_class_can_be_kept_to_its_own_guarantee(h: Harness) -> None:
    spec = LimitSpec(max_concurrency=10, guaranteed=(("batch", LimitSpec(max_concurrency=1)),))
    await h.apply({"model:m": spec}, priority=PRIORITY)
    assert isinstance(await h.acquire(["model:m"], 0, "batch", use_pool=False), Lease)
    assert isinstance(await h.acquire(["model:m"], 0, "batch", use_pool=False), Rejection)
    assert isinstance(await h.acquire(["model:m"], 0, "batch"), Lease)
    await h.apply({"model:p": POOL}, priority=PRIORITY)
    rej = await h.acquire(["model:p"], 10, "batch", use_pool=False)
    assert isinstance(rej, Rejection) and rej.reason is Reason.TOKENS and rej.retry_after_s == 1.0


@share_case
async def scaling_keeps_whole_slots_despite_float_error(h: Harness) -> None:
    await h.apply({"model:m": LimitSpec(max_concurrency=100)}, priority=PRIORITY)
    await h.store.set_scale("model:m", 0.29)
    assert h.snap("model:m").effective_concurrency == 29
