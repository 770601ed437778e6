import itertools
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from extproc.core.clock import FakeClock
from extproc.core.limiter import JointLimiter, Lease, LimitSpec, Reason, Rejection
from extproc.core.shares import SHARED, effective_shares

PRIORITY = ("critical", "standard", "batch")


def test_shed_order_pool_first_then_lowest_class_up() -> None:
    guarantees = {"critical": 10.0, "standard": 6.0, "batch": 4.0}  # 20 reserved of 40: pool of 20
    at = lambda s: effective_shares(40, guarantees, PRIORITY, s, whole=True)  # noqa: E731
    assert at(1.0) == {SHARED: 20, "critical": 10, "standard": 6, "batch": 4}
    assert at(0.75) == {SHARED: 10, "critical": 10, "standard": 6, "batch": 4}  # 30 left: pool shrinks
    assert at(0.5) == {SHARED: 0, "critical": 10, "standard": 6, "batch": 4}  # pool gone
    assert at(0.45) == {SHARED: 0, "critical": 10, "standard": 6, "batch": 2}  # batch cut first
    assert at(0.35) == {SHARED: 0, "critical": 10, "standard": 4, "batch": 0}  # then standard
    assert at(0.2) == {SHARED: 0, "critical": 8, "standard": 0, "batch": 0}  # critical last


@given(
    total=st.integers(1, 500),
    parts=st.lists(st.integers(0, 100), min_size=0, max_size=4),
    scale=st.floats(0.01, 1.0),
)
def test_shares_add_up_to_the_scaled_total_and_never_exceed_guarantees(
    total: int, parts: list[int], scale: float
) -> None:
    names = [f"c{i}" for i in range(len(parts))]
    guarantees = {n: float(p) for n, p in zip(names, parts, strict=True) if p}
    if sum(guarantees.values()) > total:
        return
    out = effective_shares(total, guarantees, names, scale, whole=True)
    assert sum(out.values()) == max(1, math.floor(total * scale + 1e-9))
    for name, value in guarantees.items():
        assert 0 <= out[name] <= value
    # A higher class is only cut once every lower class is at zero.
    for hi, lo in itertools.pairwise(names):
        if hi in guarantees and lo in guarantees and out[hi] < guarantees[hi]:
            assert out[lo] == 0


def limiter(spec: LimitSpec, clock: FakeClock | None = None) -> JointLimiter:
    lim = JointLimiter(clock=clock or FakeClock())
    lim.apply_limits({"model:m": spec}, priority=PRIORITY)
    return lim


POOL = LimitSpec(
    max_concurrency=10,
    tokens_per_minute=6000,
    guaranteed=(
        ("critical", LimitSpec(max_concurrency=4, tokens_per_minute=2400)),
        ("batch", LimitSpec(max_concurrency=1)),
    ),
)


def test_batch_flood_cannot_take_critical_guarantee() -> None:
    lim = limiter(POOL)
    batch = [lim.acquire(["model:m"], 10, "batch") for _ in range(20)]
    admitted = [b for b in batch if isinstance(b, Lease)]
    assert len(admitted) == 6  # its own 1 + the pool of 5
    critical = [lim.acquire(["model:m"], 10, "critical") for _ in range(4)]
    assert all(isinstance(c, Lease) for c in critical)
    assert isinstance(lim.acquire(["model:m"], 10, "critical"), Rejection)  # guarantee used, pool full


def test_borrow_and_give_back_to_the_same_share() -> None:
    lim = limiter(POOL)
    leases = [lim.acquire(["model:m"], 100, "critical") for _ in range(6)]
    assert all(isinstance(x, Lease) for x in leases)
    slots = [lease.placements[0].slot for lease in leases if isinstance(lease, Lease)]
    assert slots == ["critical"] * 4 + [SHARED] * 2
    shares = {s.name: s for s in lim.snapshot(["model:m"])[0].shares}
    assert shares["critical"].active == 4 and shares[SHARED].active == 2
    # Tokens are placed on their own: the guarantee's bucket still covered all six.
    assert shares["critical"].tokens_available == 2400 - 600
    assert shares[SHARED].tokens_available == 3600
    lease = leases[5]
    assert isinstance(lease, Lease)
    assert (lease.placements[0].slot, lease.placements[0].tokens) == (SHARED, "critical")
    lim.release(lease, 50)
    shares = {s.name: s for s in lim.snapshot(["model:m"])[0].shares}
    assert shares[SHARED].active == 1
    assert shares["critical"].tokens_available == 1800 + 50
    big = [lim.acquire(["model:m"], 1000, "critical") for _ in range(3)]
    assert [b.placements[0].tokens for b in big if isinstance(b, Lease)] == ["critical", SHARED, SHARED]


def test_unguaranteed_class_uses_only_the_pool() -> None:
    lim = limiter(POOL)
    results = [lim.acquire(["model:m"], 0, "standard") for _ in range(7)]
    assert sum(isinstance(r, Lease) for r in results) == 5
    rej = results[-1]
    assert isinstance(rej, Rejection) and rej.reason is Reason.CONCURRENCY
    assert rej.status.limit_requests == 5 and rej.status.remaining_requests == 0


def test_status_reports_guarantee_plus_pool_for_the_holder() -> None:
    lim = limiter(POOL)
    status = lim.status(["model:m"], "critical")
    assert (status.limit_requests, status.remaining_requests) == (9, 9)
    assert (status.limit_tokens, status.remaining_tokens) == (6000, 6000)
    assert lim.status(["model:m"], "standard").limit_requests == 5


def test_pressure_takes_the_pool_then_batch_and_keeps_critical() -> None:
    lim = limiter(POOL)
    lim.set_scale("model:m", 0.5)  # 5 slots: pool (5) gone, batch 1 and critical 4 kept
    assert isinstance(lim.acquire(["model:m"], 0, "standard"), Rejection)
    assert isinstance(lim.acquire(["model:m"], 0, "batch"), Lease)
    assert isinstance(lim.acquire(["model:m"], 0, "batch"), Rejection)
    lim.set_scale("model:m", 0.4)  # 4 slots: batch's guarantee cut, critical intact
    snap = {s.name: s for s in lim.snapshot(["model:m"])[0].shares}
    assert snap["batch"].effective_concurrency == 0 and snap["batch"].active == 1  # in-flight kept
    assert snap["critical"].effective_concurrency == 4
    assert all(isinstance(lim.acquire(["model:m"], 0, "critical"), Lease) for _ in range(4))


def test_token_request_too_large_for_shrunk_pool_is_retryable_but_not_for_base() -> None:
    lim = limiter(LimitSpec(tokens_per_minute=1000))
    lim.set_scale("model:m", 0.6)
    rej = lim.acquire(["model:m"], 800, None)
    assert isinstance(rej, Rejection) and rej.reason is Reason.TOKENS and rej.retry_after_s == 30.0
    rej = lim.acquire(["model:m"], 1001, None)
    assert isinstance(rej, Rejection) and rej.reason is Reason.TOO_LARGE and rej.retry_after_s is None


def test_removed_guarantee_keeps_its_leases_until_they_end() -> None:
    lim = limiter(POOL)
    lease = lim.acquire(["model:m"], 0, "critical")
    assert isinstance(lease, Lease)
    lim.apply_limits({"model:m": LimitSpec(max_concurrency=10)}, priority=PRIORITY)
    names = {s.name for s in lim.snapshot(["model:m"])[0].shares}
    assert "critical" in names
    lim.release(lease, 0)
    names = {s.name for s in lim.snapshot(["model:m"])[0].shares}
    assert names == {SHARED}


@pytest.mark.parametrize(
    "spec",
    [
        dict(max_concurrency=4, guaranteed=(("a", LimitSpec(max_concurrency=5)),)),
        dict(
            tokens_per_minute=100,
            guaranteed=(("a", LimitSpec(tokens_per_minute=60)), ("b", LimitSpec(tokens_per_minute=50))),
        ),
        dict(guaranteed=(("a", LimitSpec(max_concurrency=1)),)),
    ],
)
def test_guarantees_must_fit_the_total(spec: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="guaranteed"):
        LimitSpec(**spec)  # type: ignore[arg-type]


class GuaranteeMachine(RuleBasedStateMachine):
    """Under any interleaving and any scale, a class always gets its effective guarantee."""

    @initialize(crit=st.integers(0, 4), batch=st.integers(0, 3), pool=st.integers(0, 4))
    def setup(self, crit: int, batch: int, pool: int) -> None:
        self.clock = FakeClock()
        guaranteed = tuple(
            (n, LimitSpec(max_concurrency=v)) for n, v in (("critical", crit), ("batch", batch)) if v
        )
        self.total = crit + batch + pool
        self.lim = JointLimiter(clock=self.clock)
        self.lim.apply_limits(
            {"model:m": LimitSpec(max_concurrency=self.total, guaranteed=guaranteed)}, priority=PRIORITY
        )
        self.open: list[Lease] = []

    def shares(self) -> dict[str, tuple[float | None, int]]:
        snap = self.lim.snapshot(["model:m"])[0]
        return {s.name: (s.effective_concurrency, s.active) for s in snap.shares}

    @rule(holder=st.sampled_from(["critical", "standard", "batch"]))
    def acquire(self, holder: str) -> None:
        before = self.shares()
        result = self.lim.acquire(["model:m"], 0, holder)
        if holder in before:
            cap, active = before[holder]
            if cap is not None and active < cap:
                assert isinstance(result, Lease), f"{holder} refused inside its guarantee"
                assert result.placements[0].slot == holder
        if isinstance(result, Lease):
            self.open.append(result)

    @precondition(lambda self: bool(self.open))
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        lease = self.open.pop(data.draw(st.integers(0, len(self.open) - 1)))
        assert self.lim.release(lease, 0)

    @rule(scale=st.sampled_from([1.0, 0.8, 0.6, 0.4, 0.2]))
    def pressure(self, scale: float) -> None:
        if self.total:
            self.lim.set_scale("model:m", scale)

    @invariant()
    def leases_are_where_they_say(self) -> None:
        shares = self.shares()
        for name, (_cap, active) in shares.items():
            assert active == sum(1 for lease in self.open if lease.placements[0].slot == name)

    @invariant()
    def new_admissions_respect_effective_shares(self) -> None:
        snap = self.lim.snapshot(["model:m"])[0]
        if snap.effective_concurrency is not None and snap.scale == 1.0:
            assert snap.active <= max(self.total, 1)


TestGuaranteeMachine = GuaranteeMachine.TestCase
TestGuaranteeMachine.settings = __import__("hypothesis").settings(
    max_examples=150, stateful_step_count=40, deadline=None
)


def test_removing_or_lowering_a_guarantee_never_puts_more_in_flight_than_the_total() -> None:
    lim = limiter(LimitSpec(max_concurrency=4, guaranteed=(("critical", LimitSpec(max_concurrency=2)),)))
    held = [lim.acquire(["model:m"], 0, "critical") for _ in range(2)]
    assert all(isinstance(x, Lease) for x in held)
    lim.apply_limits({"model:m": LimitSpec(max_concurrency=4)}, priority=PRIORITY)  # guarantee removed
    more = [lim.acquire(["model:m"], 0, "standard") for _ in range(4)]
    assert sum(isinstance(x, Lease) for x in more) == 2
    assert lim.snapshot(["model:m"])[0].active == 4
    lim2 = limiter(LimitSpec(max_concurrency=4, guaranteed=(("critical", LimitSpec(max_concurrency=3)),)))
    held = [lim2.acquire(["model:m"], 0, "critical") for _ in range(3)]
    lowered = LimitSpec(max_concurrency=4, guaranteed=(("critical", LimitSpec(max_concurrency=1)),))
    lim2.apply_limits({"model:m": lowered}, priority=PRIORITY)
    more = [lim2.acquire(["model:m"], 0, "standard") for _ in range(4)]
    assert sum(isinstance(x, Lease) for x in more) == 1
    assert lim2.snapshot(["model:m"])[0].active == 4


def test_a_class_can_be_kept_to_its_own_guarantee() -> None:
    lim = limiter(LimitSpec(max_concurrency=10, guaranteed=(("batch", LimitSpec(max_concurrency=1)),)))
    assert isinstance(lim.acquire(["model:m"], 0, "batch", use_pool=False), Lease)
    assert isinstance(lim.acquire(["model:m"], 0, "batch", use_pool=False), Rejection)  # pool not offered
    assert isinstance(lim.acquire(["model:m"], 0, "batch"), Lease)
    # Without a token guarantee of its own, a class kept off the pool gets no pool tokens either.
    lim = limiter(POOL)
    rej = lim.acquire(["model:m"], 10, "batch", use_pool=False)
    assert isinstance(rej, Rejection) and rej.reason is Reason.TOKENS and rej.retry_after_s == 1.0


def test_scaling_keeps_whole_slots_despite_float_error() -> None:
    lim = limiter(LimitSpec(max_concurrency=100))
    lim.set_scale("model:m", 0.29)
    assert lim.snapshot(["model:m"])[0].effective_concurrency == 29
