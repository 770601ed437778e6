"""Readings no server can have are missing samples, never readings: at the parser, on the wire, in the pool.

The values are those a fault run sent: KV usage NaN on one endpoint beside 0.95 on another (the pool's
aggregate was NaN and the scale stayed 1.0), usage -0.5 and -inf (clamped to 0 and trusted), and a
capacity of 2^64 - 1 (the KV budget's headroom became 7.4e18, so it never refused).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from extproc.config import parse_config
from extproc.core.engine.adaptive import AdaptiveConfig
from extproc.kvfeed.engines import ServerKind
from extproc.kvfeed.parse import MetricsParseError, PageFilter, parse_metrics
from extproc.kvfeed.proto import feedback_pb2
from extproc.kvfeed.sample import MAX_KV_CAPACITY_TOKENS, FeedSample, checked, from_proto, problem
from extproc.kvfeed.subscriber.loop import FeedbackLoop
from extproc.kvfeed.subscriber.metrics import register_feedback_metrics
from extproc.kvfeed.subscriber.runtime import FeedbackRuntime
from extproc.kvfeed.subscriber.settings import SubscriberConfig
from tests.support.metric_pages import DATA

NAN, INF = math.nan, math.inf


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def sample(
    endpoint: str,
    kv: float | None,
    *,
    waiting: float | None = 0.0,
    running: float | None = 1.0,
    preemptions: float | None = 0.0,
    cap: int | None = 1000,
    t: float = 1.0,
) -> FeedSample:
    return FeedSample("node", endpoint, "m", ServerKind.VLLM, kv, waiting, running, preemptions, cap, t, True)


def loop_and_registry(clock: Clock) -> tuple[FeedbackLoop, CollectorRegistry]:
    registry = CollectorRegistry()
    loop = FeedbackLoop(
        SubscriberConfig(exporters=("127.0.0.1:1",)),
        {"m": AdaptiveConfig()},
        clock,
        metrics=register_feedback_metrics(registry),
    )
    return loop, registry


@pytest.mark.parametrize(
    ("fields", "why"),
    [
        ({"kv": NAN}, "kv_usage nan"),
        ({"kv": -0.5}, "kv_usage -0.5"),
        ({"kv": -INF}, "kv_usage -inf"),
        ({"kv": INF}, "kv_usage inf"),
        ({"waiting": -1.0}, "requests_waiting -1.0"),
        ({"running": NAN}, "requests_running nan"),
        ({"preemptions": INF}, "preemptions_total inf"),
        ({"cap": 0}, "kv_capacity_tokens 0"),
        ({"cap": -5}, "kv_capacity_tokens -5"),
        ({"cap": 2**64 - 1}, "kv_capacity_tokens 18446744073709551615"),
        ({"cap": MAX_KV_CAPACITY_TOKENS + 1}, "kv_capacity_tokens 1099511627777"),
    ],
)
def test_an_impossible_reading_makes_the_sample_down(fields: dict[str, float], why: str) -> None:
    args: dict[str, Any] = {"kv": 0.5} | fields
    kv = args.pop("kv")
    raw = sample("a:1", kv, **args)
    assert problem(raw) is not None and problem(raw).startswith(why)  # type: ignore[union-attr]
    down = checked(raw)
    assert not down.up and down.error.startswith(f"invalid: {why}")
    assert down.kv_usage is None and down.kv_capacity_tokens is None
    assert down.key == raw.key and down.sample_time == raw.sample_time


@pytest.mark.parametrize(
    ("kv", "cap", "expected_kv"),
    [(0.0, 1, 0.0), (0.95, MAX_KV_CAPACITY_TOKENS, 0.95), (7.5, 1000, 1.0), (None, None, None)],
)
def test_plausible_readings_pass_and_a_usage_above_one_reads_as_full(
    kv: float | None, cap: int | None, expected_kv: float | None
) -> None:
    out = checked(sample("a:1", kv, cap=cap))
    assert out.up and out.kv_usage == expected_kv and out.kv_capacity_tokens == cap


def test_nan_on_one_endpoint_does_not_poison_the_pool() -> None:
    """NaN on A and 0.95 on B: the pool reads B (0.95), so the scale is 0.6 with the default watermarks."""
    clock = Clock()
    loop, registry = loop_and_registry(clock)
    for t in (1.0, 2.0):  # both healthy until the scale has recovered from the stale start to 1.0
        loop.subscriber.ingest(sample("a:1", 0.1, t=t))
        loop.subscriber.ingest(sample("b:1", 0.1, t=t))
        clock.now += 10
    assert loop.state("m").scale == 1.0  # type: ignore[union-attr]
    loop.subscriber.ingest(sample("a:1", NAN, t=3.0))
    loop.subscriber.ingest(sample("b:1", 0.95, t=3.0))
    state = loop.state("m")
    assert state is not None and not state.stale
    assert state.kv_usage == pytest.approx(0.95)
    assert state.target_scale == pytest.approx(0.6) and state.scale == pytest.approx(0.6)
    snap = loop.snapshots()["m"]
    assert (snap.endpoints_fresh, snap.endpoints_known, snap.kv_capacity_tokens) == (1, 2, 1000)
    assert registry.get_sample_value("extproc_feed_invalid_samples_total", {"field": "kv_usage"}) == 1


@pytest.mark.parametrize("kv", [NAN, -0.5, -INF])
def test_an_endpoint_with_an_impossible_usage_is_missing_and_its_pool_stale(kv: float) -> None:
    """The only endpoint sends nonsense after a good sample: the pool goes stale at once (the safe scale),
    where before it was trusted at scale 1.0."""
    clock = Clock()
    loop, _ = loop_and_registry(clock)
    loop.subscriber.ingest(sample("a:1", 0.1, t=1.0))
    clock.now += 20  # long enough to have recovered to 1.0 from the stale start
    loop.subscriber.ingest(sample("a:1", 0.1, t=2.0))
    assert loop.state("m").scale == 1.0  # type: ignore[union-attr]
    loop.subscriber.ingest(sample("a:1", kv, t=3.0))
    state = loop.state("m")
    assert state is not None and state.stale and state.scale == pytest.approx(0.6)
    assert loop.capacity_tokens("m") is None


def test_the_wire_is_not_trusted() -> None:
    """A KvSample that an exporter (or anything speaking the protocol) sends with NaN or 2^64 - 1 tokens."""
    clock = Clock()
    loop, registry = loop_and_registry(clock)
    nan_msg = feedback_pb2.KvSample(node="n", endpoint="a:1", model="m", up=True, kv_usage=NAN)
    nan_msg.sample_time.seconds = 1
    huge = feedback_pb2.KvSample(
        node="n", endpoint="b:1", model="m", up=True, kv_usage=0.2, kv_capacity_tokens=2**64 - 1
    )
    huge.sample_time.seconds = 1
    zero = feedback_pb2.KvSample(node="n", endpoint="c:1", model="m", up=True, kv_usage=0.2)
    zero.kv_capacity_tokens = 0  # explicitly zero: no server has an empty cache
    zero.sample_time.seconds = 1
    for msg in (nan_msg, huge, zero):
        loop.subscriber.ingest(from_proto(msg))
    assert all(not s.sample.up for s in loop.subscriber.samples())
    assert loop.state("m").stale  # type: ignore[union-attr]
    assert registry.get_sample_value("extproc_feed_invalid_samples_total", {"field": "kv_usage"}) == 1
    counted = registry.get_sample_value("extproc_feed_invalid_samples_total", {"field": "kv_capacity_tokens"})
    assert counted == 2
    # An unset capacity (an exporter that does not know it) is unknown, not invalid.
    unknown = feedback_pb2.KvSample(node="n", endpoint="d:1", model="m", up=True, kv_usage=0.2)
    unknown.sample_time.seconds = 1
    back = from_proto(unknown)
    assert back.kv_capacity_tokens is None and checked(back).up


def test_a_capacity_of_2_to_the_64_leaves_the_budget_on_the_last_good_capacity() -> None:
    async def scenario() -> None:
        clock = Clock()
        runtime = FeedbackRuntime(CollectorRegistry(), lambda key, scale: None, clock)
        feed = {"direct_targets": [{"url": "http://127.0.0.1:1/metrics", "kind": "vllm", "model": "m"}]}
        config = parse_config({"feedback": feed, "kv_budget": {"enabled": True}}).feedback
        await runtime.apply(config, ["m"])
        try:
            assert runtime.loop is not None
            runtime.loop.subscriber.ingest(sample("a:1", 0.1, cap=4096, t=1.0))
            runtime.loop.subscriber.ingest(sample("a:1", 0.1, cap=2**64 - 1, t=2.0))
            budget = runtime.budget("m")
            assert budget is not None and budget.capacity_tokens == 4096
            headroom = budget.headroom_tokens
            assert headroom is not None and headroom < 4096
        finally:
            await runtime.stop()

    asyncio.run(scenario())


@pytest.mark.parametrize("value", ["NaN", "-0.5", "-Inf", "+Inf"])
def test_a_page_with_an_impossible_usage_is_refused_not_read_as_empty(value: str) -> None:
    page = f'vllm:kv_cache_usage_perc{{model_name="m"}} {value}\n'
    signals = parse_metrics(page)["m"]
    assert signals.kv_usage is not None and math.isnan(signals.kv_usage)
    out = checked(FeedSample.from_signals("n", "a:1", signals, 1.0, 0.0))
    assert not out.up and out.error.startswith("invalid: kv_usage")


def test_one_nan_engine_of_two_makes_the_endpoint_missing() -> None:
    """Data-parallel engines on one page: the fullest one decides, and a NaN one cannot be outvoted."""
    page = "".join(
        f'vllm:kv_cache_usage_perc{{model_name="m",engine="{e}"}} {v}\n'
        for e, v in (("0", "0.95"), ("1", "NaN"))
    )
    for text in (page, "".join(reversed(page.splitlines(keepends=True)))):
        kv = parse_metrics(text)["m"].kv_usage
        assert kv is not None and math.isnan(kv)


def test_negative_count_and_infinite_capacity_are_refused() -> None:
    page = (
        'vllm:num_requests_waiting{model_name="m",engine="0"} 3\n'
        'vllm:num_requests_waiting{model_name="m",engine="1"} -2\n'
        'vllm:cache_config_info{model_name="m",engine="0",kv_cache_size_tokens="1e300"} 1\n'
    )
    signals = parse_metrics(page)["m"]
    out = checked(FeedSample.from_signals("n", "a:1", signals, 1.0, 0.0))
    assert not out.up and out.error.startswith("invalid: requests_waiting nan")
    signals = parse_metrics(page.replace(" -2\n", " 2\n"))["m"]
    assert signals.kv_capacity_tokens is not None and signals.kv_capacity_tokens > MAX_KV_CAPACITY_TOKENS
    out = checked(FeedSample.from_signals("n", "a:1", signals, 1.0, 0.0))
    assert not out.up and out.error.startswith("invalid: kv_capacity_tokens")


def test_page_filter_in_tiny_pieces_gives_the_same_signals() -> None:
    text = (
        "# HELP vllm:kv_cache_usage_perc usage\n"
        'vllm:kv_cache_usage_perc{model_name="m",engine="0"} 0.5\n'
        'vllm:e2e_request_latency_seconds_bucket{model_name="m",le="1.0"} 7\n'
        * 50
        + 'vllm:num_requests_waiting{model_name="m",engine="0"} 4\n'
        'vllm:cache_config_info{model_name="m",engine="0",block_size="16",num_gpu_blocks="100"} 1'
    )
    for size in (1, 3, 64, len(text)):
        page = PageFilter()
        data = text.encode()
        for i in range(0, len(data), size):
            page.feed(data[i : i + size])
        assert parse_metrics(page.text()) == parse_metrics(text)
    kept = PageFilter()
    kept.feed(text.encode())
    # Only the lines read, one other sample line, and an empty line per dropped one.
    assert kept.text().count("e2e_request_latency") == 1
    assert kept.text().count("\n") == text.count("\n") + 1


@pytest.mark.parametrize("name", sorted(p.name for p in DATA.glob("*.txt")))
def test_page_filter_reads_every_fixture_as_the_whole_page_parser_does(name: str) -> None:
    text = (DATA / name).read_text()
    page = PageFilter()
    data = text.encode()
    try:
        for i in range(0, len(data), 7):
            page.feed(data[i : i + 7])
        filtered: object = parse_metrics(page.text())
    except MetricsParseError as exc:
        filtered = type(exc)
    try:
        whole: object = parse_metrics(text)
    except MetricsParseError as exc:
        whole = type(exc)
    assert filtered == whole


@given(st.binary(max_size=300))
def test_page_filter_raises_only_parse_errors(data: bytes) -> None:
    with contextlib.suppress(MetricsParseError, UnicodeDecodeError):
        page = PageFilter()
        page.feed(data)
        parse_metrics(page.text())
