"""Adaptive controller: curve, queue term, hysteresis, staleness; all with explicit `now` values."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from extproc.core.engine.adaptive import (
    ENGINE_DOWN_GRACE_S,
    AdaptiveConfig,
    AdaptiveController,
    ControllerState,
)


def fresh_controller(
    cfg: AdaptiveConfig | None = None, kv: float = 0.0, now: float = 0.0
) -> AdaptiveController:
    """A controller that has already recovered to full scale on a low reading."""
    ctl = AdaptiveController(cfg or AdaptiveConfig(), now=now - 100.0)
    ctl.observe(kv, 0, newest_sample_at=now - 100.0, now=now - 100.0)
    for t in range(-99, 1):
        ctl.observe(kv, 0, newest_sample_at=now + t, now=now + t)
    return ctl


@pytest.mark.parametrize(
    ("kv", "expected"),
    [(0.0, 1.0), (0.70, 1.0), (0.775, 0.80), (0.85, 0.60), (0.95, 0.60), (1.0, 0.60)],
)
def test_kv_curve_exact_values(kv: float, expected: float) -> None:
    ctl = AdaptiveController(AdaptiveConfig(), now=0.0)
    assert ctl.target_for(kv, 0) == pytest.approx(expected)


def test_drop_applies_at_once_and_is_exact() -> None:
    ctl = fresh_controller()
    assert ctl.state.scale == 1.0
    st1 = ctl.observe(0.775, 0, newest_sample_at=0.5, now=0.5)
    assert st1.scale == pytest.approx(0.8)
    st2 = ctl.observe(0.95, 0, newest_sample_at=0.6, now=0.6)
    assert st2.scale == pytest.approx(0.6)
    assert st2.target_scale == pytest.approx(0.6)
    assert not st2.stale


def test_queue_term_takes_the_min() -> None:
    cfg = AdaptiveConfig(waiting_low=2, waiting_high=10)
    ctl = AdaptiveController(cfg, now=0.0)
    assert ctl.target_for(0.1, 2) == 1.0
    assert ctl.target_for(0.1, 6) == pytest.approx(0.8)
    assert ctl.target_for(0.1, 10) == pytest.approx(0.6)
    assert ctl.target_for(0.1, 500) == pytest.approx(0.6)
    # KV term 0.8, queue term 0.9: the lower wins.
    assert ctl.target_for(0.775, 4) == pytest.approx(0.8)
    assert ctl.target_for(0.72, 8) == pytest.approx(min(1 - 0.4 * 0.02 / 0.15, 0.7))


def test_recovery_is_rate_limited() -> None:
    ctl = fresh_controller()
    ctl.observe(0.95, 0, newest_sample_at=1.0, now=1.0)
    assert ctl.state.scale == pytest.approx(0.6)
    s = ctl.observe(0.1, 0, newest_sample_at=2.0, now=2.0)
    assert s.target_scale == 1.0
    assert s.scale == pytest.approx(0.65)
    s = ctl.observe(0.1, 0, newest_sample_at=4.0, now=4.0)
    assert s.scale == pytest.approx(0.75)
    s = ctl.tick(9.0)
    assert s.scale == 1.0  # 0.75 + 5 s x 0.05 = 1.0, capped at the target


def test_one_noisy_sample_drops_then_recovers_gradually() -> None:
    ctl = fresh_controller()
    scales = []
    for t in range(1, 12):
        kv = 0.99 if t == 3 else 0.5
        scales.append(ctl.observe(kv, 0, newest_sample_at=float(t), now=float(t)).scale)
    assert scales[:2] == [1.0, 1.0]
    assert scales[2] == pytest.approx(0.6)
    assert scales[3] == pytest.approx(0.65)
    assert all(b - a == pytest.approx(0.05) for a, b in itertools.pairwise(scales[2:10]))
    assert scales[10] == pytest.approx(1.0)


def test_recovery_rate_uses_now_between_ticks() -> None:
    cfg = AdaptiveConfig(recovery_per_second=0.2)
    ctl = fresh_controller(cfg)
    ctl.observe(0.9, 0, newest_sample_at=1.0, now=1.0)
    ctl.observe(0.0, 0, newest_sample_at=1.0, now=1.0)
    assert ctl.tick(1.25).scale == pytest.approx(0.65)
    assert ctl.tick(1.5).scale == pytest.approx(0.7)


def test_starts_stale_at_stale_scale() -> None:
    ctl = AdaptiveController(AdaptiveConfig(), now=10.0)
    assert ctl.state == ControllerState(
        kv_usage=None, waiting=0.0, target_scale=0.6, scale=0.6, stale=True, updated_at=10.0
    )


def test_staleness_fallback_and_recovery() -> None:
    cfg = AdaptiveConfig(stale_after_seconds=5.0, stale_scale=0.5, min_scale=0.6)
    ctl = fresh_controller(cfg)
    assert ctl.tick(5.0).stale is False  # exactly at the window: still fresh
    s = ctl.tick(5.01)
    assert s.stale and s.scale == pytest.approx(0.5) and s.target_scale == pytest.approx(0.5)
    # Samples come back: gradual recovery from the stale scale.
    s = ctl.observe(0.1, 0, newest_sample_at=10.0, now=10.0)
    assert not s.stale
    assert s.scale == pytest.approx(0.5 + 0.05 * (10.0 - 5.01))
    assert ctl.tick(30.0).stale is True  # fed nothing newer since 10.0


def test_observe_with_no_fresh_sample_is_stale() -> None:
    ctl = fresh_controller()
    s = ctl.observe(0.1, 0, newest_sample_at=None, now=1.0)
    assert s.stale and s.scale == pytest.approx(0.6)


def test_old_sample_time_does_not_refresh() -> None:
    ctl = fresh_controller()
    ctl.observe(0.1, 0, newest_sample_at=0.0, now=0.0)
    s = ctl.observe(0.1, 0, newest_sample_at=-50.0, now=5.5)
    assert s.stale


@pytest.mark.parametrize("bad", [math.nan, -1.0, math.inf, 7.0])
def test_bad_gauges_are_clamped_or_ignored(bad: float) -> None:
    ctl = fresh_controller()
    s = ctl.observe(bad, bad, newest_sample_at=1.0, now=1.0)
    assert 0.6 <= s.scale <= 1.0


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"low_watermark": 0.9, "high_watermark": 0.8}, "low_watermark"),
        ({"low_watermark": 0.85, "high_watermark": 0.85}, "low_watermark"),
        ({"high_watermark": 1.5}, "high_watermark"),
        ({"min_scale": 0.0}, "min_scale"),
        ({"min_scale": 1.2}, "min_scale"),
        ({"waiting_low": 5, "waiting_high": 5}, "waiting_high"),
        ({"waiting_low": -1}, "waiting_low"),
        ({"recovery_per_second": 0}, "recovery_per_second"),
        ({"stale_after_seconds": -1}, "stale_after_seconds"),
        ({"stale_scale": 0.0}, "stale_scale"),
        ({"low_watermark": math.nan}, "low_watermark"),
    ],
)
def test_config_validation_names_the_key(kwargs: dict[str, float], key: str) -> None:
    with pytest.raises(ValueError, match=key):
        AdaptiveConfig(**kwargs)


step = st.tuples(
    st.floats(min_value=0.0, max_value=30.0, allow_nan=False),  # time advance
    st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True)),  # kv usage
    st.floats(allow_nan=True, allow_infinity=True),  # waiting
    st.booleans(),  # sample arrived
)


@given(
    low=st.floats(min_value=0.0, max_value=0.9),
    gap=st.floats(min_value=0.01, max_value=0.5),
    min_scale=st.floats(min_value=0.05, max_value=1.0),
    steps=st.lists(step, max_size=60),
)
def test_scale_always_within_bounds(
    low: float, gap: float, min_scale: float, steps: list[tuple[float, float | None, float, bool]]
) -> None:
    cfg = AdaptiveConfig(low_watermark=low, high_watermark=min(1.0, low + gap), min_scale=min_scale)
    now = 0.0
    ctl = AdaptiveController(cfg, now=now)
    newest: float | None = None
    for dt, kv, waiting, arrived in steps:
        now += dt
        if arrived:
            newest = now
            s = ctl.observe(kv, waiting, newest_sample_at=newest, now=now)
        else:
            s = ctl.tick(now)
        assert min_scale - 1e-12 <= s.scale <= 1.0
        assert s.scale <= max(s.target_scale, s.scale)


def test_an_engine_refusal_drops_the_scale_at_once_and_it_recovers_as_usual() -> None:
    """A queue-full refusal is a signal like a queue at `waiting_high`: `min_scale` now, then the usual
    `recovery_per_second` back towards what the gauges ask for."""
    ctl = fresh_controller(now=10.0)
    assert ctl.state.scale == 1.0
    refused = ctl.refused(10.0)
    assert refused.scale == pytest.approx(0.6) and refused.target_scale == pytest.approx(0.6)
    assert not refused.stale and refused.kv_usage == 0.0
    assert ctl.observe(0.0, 0, newest_sample_at=12.0, now=12.0).scale == pytest.approx(0.7)
    assert ctl.observe(0.0, 0, newest_sample_at=20.0, now=20.0).scale == pytest.approx(1.0)


def test_an_engine_refusal_never_raises_a_lower_scale() -> None:
    ctl = AdaptiveController(AdaptiveConfig(stale_scale=0.3), now=0.0)
    assert ctl.refused(1.0).scale == pytest.approx(0.3)


def test_engines_down_hold_the_scale_and_say_so_only_after_the_grace() -> None:
    """A fresh feed showing every endpoint refusing connections is neither KV pressure nor a blind sidecar:
    the scale stays where it was (not `stale_scale`), and the pool counts as down once that has lasted the
    grace, from the first such reading."""
    ctl = fresh_controller()
    assert ctl.state.scale == 1.0
    first = ctl.unreachable(1.0)
    assert (first.scale, first.stale, first.engine_down, first.down_since) == (1.0, False, False, 1.0)
    assert not ctl.unreachable(1.0 + ENGINE_DOWN_GRACE_S - 0.01).engine_down
    later = ctl.unreachable(1.0 + ENGINE_DOWN_GRACE_S)
    assert later.engine_down and later.down_since == 1.0
    # Long past stale_after_seconds (5 s) with no up sample: still down, still at full scale.
    held = ctl.unreachable(60.0)
    assert (held.scale, held.stale, held.engine_down, held.down_since) == (1.0, False, True, 1.0)


def test_an_engine_back_ends_the_outage_at_once_with_the_scale_it_had() -> None:
    ctl = fresh_controller()
    ctl.observe(0.775, 0, newest_sample_at=0.5, now=0.5)  # some KV pressure before the crash: 0.8
    for t in (1.0, 2.0, 30.0):
        ctl.unreachable(t)
    assert ctl.state.engine_down and ctl.state.scale == pytest.approx(0.8)
    back = ctl.observe(0.0, 0, newest_sample_at=31.0, now=31.0)
    assert not back.engine_down and back.down_since is None and not back.stale
    # Recovery runs from the return at the usual rate, not from before the outage (no 29 s credit).
    assert back.scale == pytest.approx(0.8 + 0.05 * 1.0)
    # A new outage starts its own grace.
    assert not ctl.unreachable(32.0).engine_down
    assert ctl.unreachable(33.0).down_since == 32.0


def test_a_stale_feed_after_an_outage_falls_to_the_stale_scale() -> None:
    """The exporter gone too (its down samples age out): the sidecar is blind again, not told of an outage."""
    ctl = fresh_controller()
    ctl.unreachable(1.0)
    ctl.unreachable(3.0)
    stale = ctl.observe(None, 0, newest_sample_at=None, now=10.0)
    assert stale.stale and not stale.engine_down and stale.scale == pytest.approx(0.6)
