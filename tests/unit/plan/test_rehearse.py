"""The virtual-time rehearsal: deterministic, driven by the simulator's scheduler and the sidecar's core."""

from __future__ import annotations

import pytest

from extproc.core.engine.adaptive import AdaptiveConfig
from extproc.core.kv.budget import BookingMode
from extproc.plan.rehearse import (
    EngineSetup,
    RehearsalLimits,
    percentile,
    rehearse,
)
from extproc.plan.traffic import TraceRequest, synthetic_sample
from extproc.sim.scheduler import StepTiming

SMALL = EngineSetup(
    num_gpu_blocks=200,
    block_size=16,
    max_model_len=1024,
    max_num_seqs=64,
    max_num_batched_tokens=2048,
    timing=StepTiming(),
)
BURST = [TraceRequest(0.001 * i, 200, 300) for i in range(40)]


def test_overload_preempts_without_limits_and_not_with_a_kv_budget() -> None:
    bare = rehearse(BURST, SMALL, None)
    assert bare.preemptions > 0
    assert bare.completed == 40 and bare.rejections == 0
    budget = rehearse(BURST, SMALL, RehearsalLimits("m", max_tokens=300, kv_target_utilization=0.9))
    assert budget.preemptions == 0
    assert budget.rejected == {"kv_budget": 40 - budget.admitted}
    # 0.9 x 3,200 tokens / (200 + 300) per request: 5 requests fit at once.
    assert budget.admitted == 5
    assert budget.peak_kv_usage <= 0.9


def test_concurrency_and_tpm_rejections_carry_the_sidecars_reasons() -> None:
    slots = rehearse(BURST, SMALL, RehearsalLimits("m", max_tokens=300, max_concurrency=4))
    assert slots.admitted == 4 and slots.rejected == {"concurrency": 36}
    tokens = rehearse(BURST, SMALL, RehearsalLimits("m", max_tokens=300, tokens_per_minute=2000))
    assert tokens.admitted == 4 and tokens.rejected == {"tokens": 36}  # 4 x 500 reserved
    too_large = rehearse(BURST[:1], SMALL, RehearsalLimits("m", max_tokens=300, tokens_per_minute=100))
    assert too_large.rejected == {"request_exceeds_token_limit": 1}


def test_context_length_is_checked_before_admission() -> None:
    result = rehearse([TraceRequest(0.0, 1024, 5), TraceRequest(0.0, 1000, 50)], SMALL, None)
    assert result.rejected == {"context_length": 1}
    # The second request's output is capped by the context: 1024 - 1000 = 24 tokens.
    assert result.output_tokens == 24


def test_adaptive_scale_starts_low_and_recovers() -> None:
    sample = synthetic_sample(200, 50, 20.0, count=300, seed=1)
    cold = RehearsalLimits("m", max_tokens=50, max_concurrency=10, adaptive=AdaptiveConfig())
    result = rehearse(sample.requests, SMALL, cold)
    # The controller starts stale at min_scale 0.6 (6 slots) and then recovers to 10; some rejections.
    assert result.rejected.get("concurrency", 0) > 0
    assert result.completed == result.admitted


def test_rehearsal_is_deterministic_and_reports_every_field() -> None:
    sample = synthetic_sample(300, 80, 30.0, count=400, seed=7)
    limits = RehearsalLimits(
        "m", max_tokens=128, max_concurrency=32, tokens_per_minute=600_000, kv_target_utilization=0.9
    )
    first = rehearse(sample.requests, SMALL, limits)
    second = rehearse(sample.requests, SMALL, limits)
    assert first == second
    data = first.to_dict()
    for key in (
        "requests",
        "admitted",
        "completed",
        "rejections",
        "rejected_by_reason",
        "preemptions",
        "output_tokens",
        "goodput_output_tokens_per_s",
        "ttft_p50_s",
        "ttft_p99_s",
        "e2e_p99_s",
        "peak_kv_usage",
    ):
        assert key in data
    assert first.requests == 400 and first.admitted + first.rejections == 400
    assert first.ttft_p50_s is not None and 0 < first.ttft_p50_s <= (first.ttft_p99_s or 0)
    assert first.goodput_tokens_per_s == pytest.approx(first.output_tokens / first.duration_s)


def test_an_engine_that_cannot_hold_one_context_is_refused() -> None:
    tiny = EngineSetup(10, 16, 1024, 8, 512, StepTiming())
    with pytest.raises(ValueError, match="vLLM refuses to start"):
        rehearse(BURST, tiny, None)


def test_percentile_is_nearest_rank() -> None:
    assert percentile([], 0.5) is None
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert percentile([float(i) for i in range(1, 101)], 0.99) == 99.0


def test_forecast_booking_fills_more_of_the_cache_than_lifetime_without_preempting() -> None:
    """The rehearsal books KV as the sidecar's default does (forecast); lifetime stays available."""
    sample = synthetic_sample(200, 300, 40.0, count=400, seed=1)
    results = {
        booking: rehearse(
            sample.requests,
            SMALL,
            RehearsalLimits("m", max_tokens=300, kv_target_utilization=0.9, kv_booking=booking),
        )
        for booking in BookingMode
    }
    assert RehearsalLimits("m", max_tokens=1).kv_booking is BookingMode.FORECAST
    lifetime, forecast = results[BookingMode.LIFETIME], results[BookingMode.FORECAST]
    assert lifetime.preemptions == 0 and forecast.preemptions == 0
    assert forecast.admitted > lifetime.admitted
    assert forecast.mean_kv_usage > lifetime.mean_kv_usage
