"""Shares of a key: the split by class (`effective_shares`), the guarantees' validation and a state machine
over a `JointLimiter` on a fake clock. The shares' behaviour cases through a store are written once in
tests/support/limiter_cases.py and run here on the in-process store (tests/component/store/test_parity.py
runs them on Redis); `GuaranteeMachine` stays unit-only: hundreds of hypothesis interleavings."""

import itertools
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from extproc.core.clock import FakeClock
from extproc.core.limiter.limiter import JointLimiter, Lease, LimitSpec
from extproc.core.limiter.shares import SHARED, effective_shares
from tests.support.limiter_cases import SHARE_CASES, Case, case_id
from tests.support.store_harness import local_harness

PRIORITY = ("critical", "standard", "batch")


def test_shed_order_pool_first_then_lowest_class_up() -> None:
    guarantees = {"critical": 10.0, "standard": 6.0, "batch": 4.0}  # 20 reserved of 40: pool of 20

    def at(scale: float) -> dict[str, float]:
        return effective_shares(40, guarantees, PRIORITY, scale, whole=True)

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


@pytest.mark.parametrize("case", SHARE_CASES, ids=case_id)
async def test_share_case(case: Case) -> None:
    await case(local_harness())


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
