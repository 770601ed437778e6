"""The decode pace per running sequence: derived between scrapes, carried in the feed, aggregated per pool."""

from __future__ import annotations

import math

import pytest
from prometheus_client import CollectorRegistry

from extproc.core.engine.adaptive import AdaptiveConfig
from extproc.kvfeed.engines import ServerKind
from extproc.kvfeed.pace import MAX_DECODE_TOKENS_PER_SECOND, EnginePaceMeter, plausible_pace
from extproc.kvfeed.parse import parse_metrics
from extproc.kvfeed.sample import FeedSample, checked, from_proto, to_proto
from extproc.kvfeed.subscriber.aggregate import StoredSample, aggregate
from extproc.kvfeed.subscriber.loop import FeedbackLoop
from extproc.kvfeed.subscriber.metrics import register_feedback_metrics
from extproc.kvfeed.subscriber.settings import SubscriberConfig
from tests.support.metric_pages import page

KEY = ("10.0.0.1:8000", "m")


def test_pace_is_counter_growth_per_second_per_mean_running_sequence() -> None:
    meter = EnginePaceMeter()
    assert meter.observe(KEY, 1000.0, 4.0, at=10.0) is None  # the first reading is the baseline
    # 240 tokens in 2 s over (4 + 8) / 2 = 6 sequences: 20 tokens/s each
    assert meter.observe(KEY, 1240.0, 8.0, at=12.0) == pytest.approx(20.0)
    assert meter.observe(KEY, 1400.0, 8.0, at=13.0) == pytest.approx(20.0)
    assert meter.observe(("other:1", "m"), 5.0, 1.0, at=13.0) is None  # per endpoint


def test_a_counter_reset_gives_no_reading_and_becomes_the_baseline() -> None:
    meter = EnginePaceMeter()
    meter.observe(KEY, 50_000.0, 4.0, at=0.0)
    assert meter.observe(KEY, 30.0, 4.0, at=1.0) is None  # the engine restarted: its counter began again
    assert meter.observe(KEY, 110.0, 4.0, at=2.0) == pytest.approx(20.0)  # measured from the new baseline


@pytest.mark.parametrize(
    ("generated", "running", "at"),
    [
        (1100.0, 0.0, 2.0),  # the batch drained inside the window: the mean of the ends is off up to 2x
        (1080.0, 1.0, 2.0),  # it drained but one: 80 tokens of four streams over 2.5 would read 32, not 20
        (1080.0, 9.0, 2.0),  # it more than doubled: the ends' mean says little of who generated what
        (1000.0, 4.0, 2.0),  # nothing generated: a stalled engine says nothing of its pace
        (1100.0, 4.0, 1.0),  # the clock did not move
        (1100.0, 4.0, 0.5),  # nor went back
        (1010.0, 4.0, 1.5),  # the window is not a second long yet
    ],
)
def test_a_window_without_sequences_tokens_or_time_gives_no_new_pace(
    generated: float, running: float, at: float
) -> None:
    meter = EnginePaceMeter()
    meter.observe(KEY, 1000.0, 4.0, at=1.0)
    assert meter.observe(KEY, generated, running, at=at) is None  # nothing read before: nothing to give


def test_the_last_pace_is_held_while_a_window_fills_and_through_idle_windows() -> None:
    meter = EnginePaceMeter()
    meter.observe(KEY, 0.0, 4.0, at=0.0)
    assert meter.observe(KEY, 80.0, 4.0, at=1.0) == pytest.approx(20.0)
    assert meter.observe(KEY, 90.0, 4.0, at=1.25) == pytest.approx(20.0)  # the window fills: held
    assert meter.observe(KEY, 150.0, 0.0, at=2.0) == pytest.approx(20.0)  # drained: held, not 2x off
    assert meter.observe(KEY, 150.0, 0.0, at=3.0) == pytest.approx(20.0)  # idle: held
    assert meter.observe(KEY, 150.0, 2.0, at=4.0) == pytest.approx(20.0)  # starting: held
    assert meter.observe(KEY, 210.0, 2.0, at=5.0) == pytest.approx(30.0)  # a new pace
    assert meter.observe(KEY, 5.0, 2.0, at=6.0) is None  # a counter reset forgets the pace


def test_the_window_is_the_configured_length() -> None:
    meter = EnginePaceMeter(min_window_s=0.2)
    meter.observe(KEY, 0.0, 1.0, at=0.0)
    assert meter.observe(KEY, 5.0, 1.0, at=0.25) == pytest.approx(20.0)


@pytest.mark.parametrize(
    ("generated", "running"),
    [
        (math.nan, 4.0),
        (math.inf, 4.0),
        (-1.0, 4.0),
        (2000.0, math.nan),
        (2000.0, -1.0),
        (None, 4.0),
        (2000.0, None),
    ],
)
def test_a_value_no_counter_can_have_breaks_the_series(
    generated: float | None, running: float | None
) -> None:
    meter = EnginePaceMeter()
    meter.observe(KEY, 0.0, 4.0, at=0.0)
    assert meter.observe(KEY, 80.0, 4.0, at=1.0) == pytest.approx(20.0)
    assert meter.observe(KEY, generated, running, at=2.0) is None  # the pace read before is not held
    # the next good reading is a baseline, not measured against the one before the gap
    assert meter.observe(KEY, 5000.0, 4.0, at=3.0) is None
    assert meter.observe(KEY, 5120.0, 4.0, at=4.0) == pytest.approx(30.0)


def test_a_pace_beyond_any_engine_is_no_reading() -> None:
    meter = EnginePaceMeter()
    meter.observe(KEY, 0.0, 1.0, at=0.0)
    assert meter.observe(KEY, MAX_DECODE_TOKENS_PER_SECOND * 10, 1.0, at=1.0) is None
    assert [plausible_pace(v) for v in (math.nan, math.inf, -1.0, 0.0, 20.0)] == [
        None,
        None,
        None,
        None,
        20.0,
    ]


def test_forget_drops_the_endpoints_baselines() -> None:
    meter = EnginePaceMeter()
    meter.observe(KEY, 1000.0, 4.0, at=0.0)
    meter.observe(("10.0.0.1:8000", "lora"), 10.0, 1.0, at=0.0)
    meter.forget("10.0.0.1:8000")
    assert len(meter) == 0
    assert meter.observe(KEY, 1080.0, 4.0, at=1.0) is None


def test_the_parser_reads_the_generation_counter_of_vllm_and_sglang() -> None:
    vllm = parse_metrics(page("vllm_0.33.0_dp2.txt"), "vllm")["meta-llama/Llama-3.1-8B-Instruct"]
    assert vllm.generation_tokens_total == 456789.0 + 440018.0  # summed over the two data-parallel engines
    sglang_page = (
        'sglang:num_running_reqs{model_name="q",tp_rank="0"} 4.0\n'
        'sglang:realtime_tokens_total{model_name="q",tp_rank="0",mode="decode"} 777.0\n'
        'sglang:realtime_tokens_total{model_name="q",tp_rank="0",mode="prefill_compute"} 99999.0\n'
        'sglang:generation_tokens_total{model_name="q"} 5.0\n'
    )
    assert parse_metrics(sglang_page, "sglang")["q"].generation_tokens_total == 777.0


def sample(endpoint: str, pace: float | None, running: float | None = 4.0, t: float = 1.0) -> FeedSample:
    return FeedSample(
        "node", endpoint, "m", ServerKind.VLLM, 0.5, 0.0, running, 0.0, 1000, t, True,
        decode_tokens_per_second=pace,
    )  # fmt: skip


def test_the_pace_crosses_the_wire_and_an_impossible_one_is_dropped_alone() -> None:
    assert from_proto(to_proto(sample("a:1", 21.5))).decode_tokens_per_second == 21.5
    assert from_proto(to_proto(sample("a:1", None))).decode_tokens_per_second is None
    for bad in (math.nan, math.inf, -3.0, 0.0, 1e9):
        out = checked(from_proto(to_proto(sample("a:1", bad))))
        assert out.up and out.kv_usage == 0.5 and out.decode_tokens_per_second is None


def test_pool_pace_is_weighted_by_running_and_ignores_stale_or_down_endpoints() -> None:
    stored = [
        StoredSample(sample("a:1", 10.0, running=6.0), received_at=100.0),
        StoredSample(sample("b:1", 30.0, running=2.0), received_at=100.0),
        StoredSample(sample("c:1", 50.0, running=0.0), received_at=100.0),  # idle now: weight 1
        StoredSample(sample("d:1", None), received_at=100.0),  # publishes no pace
        StoredSample(sample("e:1", 500.0), received_at=80.0),  # stale
    ]
    snap = aggregate(stored, 101.0, lambda pool: 5.0)["m"]
    assert snap.decode_tokens_per_second == pytest.approx((10 * 6 + 30 * 2 + 50 * 1) / 9)
    only_stale = aggregate(stored[-1:], 101.0, lambda pool: 5.0)["m"]
    assert only_stale.stale and only_stale.decode_tokens_per_second is None


def test_the_loop_gives_the_pace_of_a_fresh_pool_only() -> None:
    now = [100.0]
    registry = CollectorRegistry()
    loop = FeedbackLoop(
        SubscriberConfig(exporters=("127.0.0.1:1",)),
        {"m": AdaptiveConfig()},
        lambda: now[0],
        metrics=register_feedback_metrics(registry),
    )
    assert loop.decode_tokens_per_second("m") is None
    loop.subscriber.ingest(sample("a:1", 18.0))
    assert loop.decode_tokens_per_second("m") == pytest.approx(18.0)
    gauge = "extproc_feed_decode_tokens_per_second"
    assert registry.get_sample_value(gauge, {"pool": "m"}) == pytest.approx(18.0)
    now[0] += 60.0
    loop.evaluate()
    assert loop.decode_tokens_per_second("m") is None  # stale: the pace is no longer read
    assert math.isnan(registry.get_sample_value(gauge, {"pool": "m"}) or 0.0)
