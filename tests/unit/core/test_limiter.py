import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from extproc.core.clock import FakeClock
from extproc.core.limiter import EAGER_KEYS, JointLimiter, Lease, LimitSpec, Reason, Rejection
from extproc.core.state import KeyState


def make(specs: dict[str, LimitSpec], clock: FakeClock | None = None) -> tuple[JointLimiter, FakeClock]:
    clock = clock or FakeClock()
    limiter = JointLimiter(clock=clock)
    limiter.apply_limits(specs)
    return limiter, clock


def test_concurrency_limit_admits_exactly_the_limit() -> None:
    limiter, _ = make({"global": LimitSpec(max_concurrency=3)})
    results = [limiter.acquire(["global"], 0) for _ in range(5)]
    leases = [r for r in results if isinstance(r, Lease)]
    rejections = [r for r in results if isinstance(r, Rejection)]
    assert len(leases) == 3
    assert len(rejections) == 2
    assert all(r.reason is Reason.CONCURRENCY and r.key == "global" for r in rejections)
    assert rejections[0].status.remaining_requests == 0
    assert rejections[0].status.limit_requests == 3


def test_token_rejection_gives_the_slot_back() -> None:
    limiter, _ = make({"m": LimitSpec(max_concurrency=2, tokens_per_minute=600)})
    assert isinstance(limiter.acquire(["m"], 500), Lease)
    rej = limiter.acquire(["m"], 500)
    assert isinstance(rej, Rejection)
    assert rej.reason is Reason.TOKENS
    assert rej.retry_after_s == pytest.approx(40.0)  # 400 missing at 10/s
    assert limiter.snapshot(["m"])[0].active == 1


def test_admitted_again_after_refill() -> None:
    limiter, clock = make({"m": LimitSpec(tokens_per_minute=600)})
    assert isinstance(limiter.acquire(["m"], 600), Lease)
    rej = limiter.acquire(["m"], 100)
    assert isinstance(rej, Rejection) and rej.retry_after_s == pytest.approx(10.0)
    clock.advance(9.9)
    assert isinstance(limiter.acquire(["m"], 100), Rejection)
    clock.advance(0.1)
    assert isinstance(limiter.acquire(["m"], 100), Lease)


def test_request_larger_than_capacity_is_refused_with_no_retry() -> None:
    limiter, _ = make({"m": LimitSpec(tokens_per_minute=600)})
    rej = limiter.acquire(["m"], 601)
    assert isinstance(rej, Rejection)
    assert rej.reason is Reason.TOO_LARGE and rej.retry_after_s is None


def test_all_or_nothing_across_keys() -> None:
    limiter, _ = make(
        {
            "global": LimitSpec(max_concurrency=10, tokens_per_minute=10_000),
            "tenant:a": LimitSpec(max_concurrency=1),
        }
    )
    assert isinstance(limiter.acquire(["global", "tenant:a"], 100), Lease)
    rej = limiter.acquire(["global", "tenant:a"], 100)
    assert isinstance(rej, Rejection) and rej.key == "tenant:a"
    g = limiter.snapshot(["global"])[0]
    assert g.active == 1
    assert g.tokens_available == 9_900


def test_settle_exactly_once_refunds_and_releases() -> None:
    limiter, _ = make({"m": LimitSpec(max_concurrency=1, tokens_per_minute=6000)})
    lease = limiter.acquire(["m"], 1000)
    assert isinstance(lease, Lease)
    assert limiter.release(lease, 300) is True
    assert limiter.release(lease, 300) is False
    assert limiter.release(lease, 0) is False
    snap = limiter.snapshot(["m"])[0]
    assert snap.active == 0
    assert snap.tokens_available == 5700  # 6000 - 300 actually used
    assert lease.actual_tokens == 300


def test_overrun_charged_as_debt() -> None:
    limiter, _ = make({"m": LimitSpec(tokens_per_minute=600)})
    lease = limiter.acquire(["m"], 600)
    assert isinstance(lease, Lease)
    limiter.release(lease, 700)
    assert limiter.snapshot(["m"])[0].tokens_available == -100
    rej = limiter.acquire(["m"], 50)
    assert isinstance(rej, Rejection) and rej.retry_after_s == pytest.approx(15.0)


def test_lowered_limit_keeps_inflight_and_admits_nothing_until_below() -> None:
    limiter, _ = make({"m": LimitSpec(max_concurrency=4)})
    leases = [limiter.acquire(["m"], 0) for _ in range(4)]
    assert all(isinstance(x, Lease) for x in leases)
    limiter.apply_limits({"m": LimitSpec(max_concurrency=2)})
    assert limiter.snapshot(["m"])[0].active == 4
    for lease in leases[:2]:
        assert isinstance(lease, Lease)
        limiter.release(lease, 0)
    assert isinstance(limiter.acquire(["m"], 0), Rejection)  # active 2, limit 2
    assert isinstance(leases[2], Lease)
    limiter.release(leases[2], 0)
    assert isinstance(limiter.acquire(["m"], 0), Lease)


def test_scale_shrinks_effective_limits_and_recovers() -> None:
    limiter, _ = make({"m": LimitSpec(max_concurrency=10, tokens_per_minute=1000)})
    limiter.set_scale("m", 0.6)
    snap = limiter.snapshot(["m"])[0]
    assert snap.effective_concurrency == 6
    assert snap.effective_tokens_per_minute == 600
    assert snap.tokens_available == 600
    limiter.set_scale("m", 1.0)
    assert limiter.snapshot(["m"])[0].effective_concurrency == 10
    with pytest.raises(ValueError):
        limiter.set_scale("m", 0)


def test_removed_key_keeps_its_leases_and_becomes_unlimited() -> None:
    limiter, _ = make({"m": LimitSpec(max_concurrency=1)})
    lease = limiter.acquire(["m"], 0)
    assert isinstance(lease, Lease)
    limiter.apply_limits({})
    assert isinstance(limiter.acquire(["m"], 0), Lease)
    assert limiter.release(lease, 0)
    assert limiter.snapshot(["m"])[0].active == 1


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


def test_slot_retry_hint_follows_hold_times() -> None:
    limiter, clock = make({"m": LimitSpec(max_concurrency=2)})
    for _ in range(10):
        lease = limiter.acquire(["m"], 0)
        assert isinstance(lease, Lease)
        clock.advance(8.0)
        limiter.release(lease, 0)
    a, b = limiter.acquire(["m"], 0), limiter.acquire(["m"], 0)
    rej = limiter.acquire(["m"], 0)
    assert isinstance(a, Lease) and isinstance(b, Lease) and isinstance(rej, Rejection)
    assert rej.retry_after_s == pytest.approx(4.0, rel=0.01)  # 8 s holds over 2 slots


def test_status_reports_tightest_key() -> None:
    limiter, _ = make(
        {"global": LimitSpec(max_concurrency=10, tokens_per_minute=1000), "m": LimitSpec(max_concurrency=2)}
    )
    lease = limiter.acquire(["global", "m"], 400)
    assert isinstance(lease, Lease)
    s = lease.status
    assert (s.limit_requests, s.remaining_requests) == (2, 1)
    assert (s.limit_tokens, s.remaining_tokens) == (1000, 600)
    assert s.reset_tokens_s == pytest.approx(24.0)


class LimiterMachine(RuleBasedStateMachine):
    """Random interleavings of acquire, release, limit changes and time never exceed a limit or leak."""

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
            expected = sum(1 for lease in self.open if key in lease.keys)
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


def test_a_request_sees_the_old_limits_or_the_new_ones_never_a_mix() -> None:
    old = {"global": LimitSpec(max_concurrency=3), "tenant:a": LimitSpec(max_concurrency=2)}
    limiter, _ = make(old)
    held = [limiter.acquire(["global", "tenant:a"], 0) for _ in range(2)]
    assert all(isinstance(h, Lease) for h in held)
    limiter.apply_limits({"global": LimitSpec(max_concurrency=10), "tenant:a": LimitSpec(max_concurrency=1)})
    refused = limiter.acquire(["global", "tenant:a"], 0)  # new global room, but the tenant's new limit
    assert isinstance(refused, Rejection) and refused.key == "tenant:a"
    assert refused.status.limit_requests == 1


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
