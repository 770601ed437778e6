"""The limiter in this process, on a fake clock.

Its behaviour cases are written once in tests/support/limiter_cases.py and run here on the in-process store
(tests/component/store/test_parity.py runs them on one Redis and a Redis Cluster). The tests below stay
unit-only, each for one reason:
- `test_admitted_exactly_when_the_retry_hint_says`: admitted at the hint's instant and not 0.1 s before,
  which only a fake clock can stop at (the shared case checks either side of it with real-time slack).
- `test_a_stale_key_is_judged_as_of_the_reload_...`: 30 s of refill across a reload, virtual time only.
- `test_defaults_by_prefix_and_pruning_idle_keys`, `test_a_reload_creates_only_the_first_keys_...`,
  `test_an_unchanged_key_is_not_rebuilt`, `test_idle_keys_past_the_first_...` and
  `test_the_keys_shown_are_bounded_...`: `JointLimiter.prune`, `EAGER_KEYS`, `KeyState.rebuild` and
  `shown_keys` are the in-process store's own memory bounds, not `LimiterStore` behaviour.
- `LimiterMachine`: hundreds of hypothesis interleavings over virtual time; minutes on a real Redis.
"""

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from extproc.core.clock import FakeClock
from extproc.core.limiter.limiter import EAGER_KEYS, JointLimiter, Lease, LimitSpec, Rejection
from extproc.core.limiter.state import KeyState
from tests.support.limiter_cases import LIMITER_CASES, Case, case_id
from tests.support.store_harness import local_harness


def make(specs: dict[str, LimitSpec], clock: FakeClock | None = None) -> tuple[JointLimiter, FakeClock]:
    clock = clock or FakeClock()
    limiter = JointLimiter(clock=clock)
    limiter.apply_limits(specs)
    return limiter, clock


@pytest.mark.parametrize("case", LIMITER_CASES, ids=case_id)
async def test_limiter_case(case: Case) -> None:
    await case(local_harness())


def test_admitted_exactly_when_the_retry_hint_says() -> None:
    limiter, clock = make({"m": LimitSpec(tokens_per_minute=600)})
    assert isinstance(limiter.acquire(["m"], 600), Lease)
    rej = limiter.acquire(["m"], 100)
    assert isinstance(rej, Rejection) and rej.retry_after_s == pytest.approx(10.0)
    clock.advance(9.9)
    assert isinstance(limiter.acquire(["m"], 100), Rejection)
    clock.advance(0.1)
    assert isinstance(limiter.acquire(["m"], 100), Lease)


def test_defaults_by_prefix_and_pruning_idle_keys() -> None:
    clock = FakeClock()
    limiter = JointLimiter(clock=clock)
    limiter.apply_limits({}, defaults={"tenant:": LimitSpec(max_concurrency=1, tokens_per_minute=600)})
    lease = limiter.acquire(["tenant:x"], 60)
    assert isinstance(lease, Lease)
    assert isinstance(limiter.acquire(["tenant:x"], 0), Rejection)
    assert limiter.prune() == 0  # holds a slot
    limiter.release(lease, 60)
    assert limiter.prune() == 0  # bucket not full yet
    clock.advance(6.0)
    assert limiter.prune() == 1
    assert limiter.snapshot(["tenant:x"]) == []


class LimiterMachine(RuleBasedStateMachine):
    """Random interleavings of acquire, release, slots given back early, limit changes and time never exceed
    a limit, free a slot twice or leak one."""

    KEYS = ("global", "model:a", "tenant:t")

    @initialize(
        g=st.integers(1, 6),
        m=st.integers(0, 4),
        tpm=st.integers(100, 5000),
    )
    def setup(self, g: int, m: int, tpm: int) -> None:
        self.clock = FakeClock()
        self.limiter = JointLimiter(clock=self.clock)
        self.limits = {"global": g, "model:a": m}
        self.limiter.apply_limits(
            {
                "global": LimitSpec(max_concurrency=g, tokens_per_minute=tpm),
                "model:a": LimitSpec(max_concurrency=m),
            }
        )
        self.open: list[Lease] = []
        self.lowered = False

    @rule(tokens=st.integers(0, 3000), with_tenant=st.booleans())
    def acquire(self, tokens: int, with_tenant: bool) -> None:
        keys = ["global", "model:a"] + (["tenant:t"] if with_tenant else [])
        before = {s.key: s.active for s in self.limiter.snapshot()}
        result = self.limiter.acquire(keys, tokens)
        after = {s.key: s.active for s in self.limiter.snapshot()}
        if isinstance(result, Lease):
            self.open.append(result)
            for k in keys:
                assert after[k] == before.get(k, 0) + 1
        else:
            assert {k: after.get(k, 0) for k in before} == before

    @precondition(lambda self: bool(self.open))
    @rule(data=st.data(), actual=st.integers(0, 4000), twice=st.booleans())
    def release(self, data: st.DataObject, actual: int, twice: bool) -> None:
        lease = self.open.pop(data.draw(st.integers(0, len(self.open) - 1)))
        assert self.limiter.release(lease, actual)
        if twice:
            assert not self.limiter.release(lease, actual)

    @precondition(lambda self: any(not lease.slot_released for lease in self.open))
    @rule(data=st.data(), twice=st.booleans())
    def release_slot(self, data: st.DataObject, twice: bool) -> None:
        holding = [lease for lease in self.open if not lease.slot_released]
        lease = holding[data.draw(st.integers(0, len(holding) - 1))]
        assert self.limiter.release_slot(lease)
        if twice:
            assert not self.limiter.release_slot(lease)

    @rule(seconds=st.floats(0, 30))
    def tick(self, seconds: float) -> None:
        self.clock.advance(seconds)

    @rule(g=st.integers(0, 6))
    def change_limit(self, g: int) -> None:
        self.limits["global"] = g
        self.lowered = True
        self.limiter.apply_limits(
            {
                "global": LimitSpec(max_concurrency=g, tokens_per_minute=1000),
                "model:a": LimitSpec(max_concurrency=self.limits["model:a"]),
            }
        )

    @invariant()
    def active_matches_open_leases(self) -> None:
        snaps = {s.key: s for s in self.limiter.snapshot()}
        for key in self.KEYS:
            expected = sum(1 for lease in self.open if key in lease.keys and not lease.slot_released)
            assert (snaps[key].active if key in snaps else 0) == expected

    @invariant()
    def never_more_than_limit_unless_lowered(self) -> None:
        if self.lowered:
            return
        snaps = {s.key: s for s in self.limiter.snapshot()}
        for key, limit in self.limits.items():
            assert snaps[key].active <= limit

    @invariant()
    def bucket_never_above_capacity(self) -> None:
        for s in self.limiter.snapshot():
            if s.tokens_available is not None and s.effective_tokens_per_minute is not None:
                assert s.tokens_available <= s.effective_tokens_per_minute + 1e-9


TestLimiterMachine = LimiterMachine.TestCase
TestLimiterMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


# -- reloads of many keys --------------------------------------------------------------------------------


def many(count: int, tpm: int = 600) -> dict[str, LimitSpec]:
    specs = {"global": LimitSpec(max_concurrency=1000)}
    specs |= {f"tenant:t{i}": LimitSpec(max_concurrency=1, tokens_per_minute=tpm) for i in range(count)}
    return specs


def test_a_reload_creates_only_the_first_keys_and_the_rest_on_first_use() -> None:
    limiter, _ = make(many(20_000))
    assert len(limiter.snapshot()) == EAGER_KEYS  # not 20,001 states built on the event loop
    last = "tenant:t19999"
    assert isinstance(limiter.acquire(["global", last], 600), Lease)
    assert isinstance(limiter.acquire(["global", last], 0), Rejection)  # its own limit, not unlimited
    assert limiter.snapshot([last])[0].effective_concurrency == 1


def test_a_stale_key_is_judged_as_of_the_reload_not_as_of_its_next_use() -> None:
    """Refill runs at the old rate until the reload and at the new one after, as an eager rebuild does."""
    limiter, clock = make({"k": LimitSpec(tokens_per_minute=600)})  # 10 tokens/s
    assert isinstance(limiter.acquire(["k"], 600), Lease)
    clock.advance(10.0)  # +100 at the old rate
    limiter.apply_limits({"k": LimitSpec(tokens_per_minute=1200)})  # 20 tokens/s from now
    clock.advance(20.0)  # +400 at the new rate; nothing touched the key meanwhile
    assert limiter.snapshot(["k"])[0].tokens_available == pytest.approx(500)


def test_an_unchanged_key_is_not_rebuilt(monkeypatch: pytest.MonkeyPatch) -> None:
    specs = many(3000)
    limiter, clock = make(specs)
    for i in range(3000):
        limiter.acquire([f"tenant:t{i}"], 1)
    rebuilt: list[str] = []
    original = KeyState.rebuild

    def counting(self: KeyState, now: float) -> None:
        rebuilt.append(repr(self.spec))
        original(self, now)

    monkeypatch.setattr(KeyState, "rebuild", counting)
    clock.advance(1.0)
    limiter.apply_limits({**specs, "tenant:t2999": LimitSpec(max_concurrency=2)})
    for i in range(3000):
        limiter.status([f"tenant:t{i}"])
    assert rebuilt == [repr(LimitSpec(max_concurrency=2))]


def test_idle_keys_past_the_first_are_forgotten_and_come_back_with_their_limits() -> None:
    limiter, clock = make(many(EAGER_KEYS + 10))
    extra = f"tenant:t{EAGER_KEYS + 5}"
    lease = limiter.acquire([extra], 60)
    assert isinstance(lease, Lease)
    limiter.release(lease, 60)
    clock.advance(6.0)  # refilled: idle
    assert limiter.prune() == 1
    assert len(limiter.snapshot()) == EAGER_KEYS  # the first configured keys stay, for their gauges
    assert limiter.snapshot([extra]) == []
    assert limiter.status([extra]).limit_requests == 1


def test_the_keys_shown_are_bounded_the_busiest_first() -> None:
    limiter, _ = make(many(EAGER_KEYS + 500))
    busy = [f"tenant:t{EAGER_KEYS + i}" for i in range(500)]
    for key in busy:
        limiter.acquire([key], 0)
    limiter.acquire(["tenant:unconfigured"], 0)
    shown = limiter.shown_keys(busiest=5)
    assert shown[:EAGER_KEYS] == list(many(EAGER_KEYS))[:EAGER_KEYS]
    assert len(shown) == EAGER_KEYS + 5
    assert all(limiter.snapshot([k])[0].active == 1 for k in shown[EAGER_KEYS:])
    assert len(limiter.snapshot()) == EAGER_KEYS + 501  # every key in use is still there, just not shown
