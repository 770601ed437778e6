"""Metric page parsing for every supported server kind, from hand-written pages in tests/data/metrics."""

from __future__ import annotations

import contextlib
import re
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from extproc.feed.parse import (
    METRIC_TABLE,
    MetricsParseError,
    ServerKind,
    normalize_usage,
    parse_metrics,
    parse_series,
)

DATA = Path(__file__).resolve().parents[2] / "data" / "metrics"
DOCS = Path(__file__).resolve().parents[3] / "docs" / "feedback.md"


def page(name: str) -> str:
    return (DATA / name).read_text()


def test_vllm_v1_data_parallel_engines() -> None:
    out = parse_metrics(page("vllm_v1_dp2.txt"), ServerKind.VLLM)
    assert list(out) == ["meta-llama/Llama-3.1-8B-Instruct"]
    s = out["meta-llama/Llama-3.1-8B-Instruct"]
    assert s.kind is ServerKind.VLLM
    assert s.kv_usage == pytest.approx(0.81)  # max over engines
    assert s.requests_waiting == 4  # 3 + 1, `_by_reason` (40 + 9) ignored
    assert s.requests_running == 12
    assert s.preemptions_total == 16  # `_created` ignored
    assert s.kv_capacity_tokens == 2 * 16 * 5691


def test_vllm_mean_aggregation() -> None:
    out = parse_metrics(page("vllm_v1_dp2.txt"), kv_aggregation="mean")
    assert out["meta-llama/Llama-3.1-8B-Instruct"].kv_usage == pytest.approx((0.62 + 0.81) / 2)


def test_vllm_legacy_names() -> None:
    s = parse_metrics(page("vllm_v0_legacy.txt"), "vllm")["Qwen/Qwen2.5-7B-Instruct"]
    assert s.kv_usage == pytest.approx(0.4375)  # gpu_cache_usage_perc, not the CPU one
    assert (s.requests_waiting, s.requests_running, s.preemptions_total) == (2, 4, 3)
    assert s.kv_capacity_tokens == 16 * 8000


def test_vllm_prefers_current_name_over_deprecated() -> None:
    s = parse_metrics(page("vllm_transition.txt"))["m"]
    assert s.kv_usage == pytest.approx(0.5)
    assert s.kv_capacity_tokens is None
    assert s.preemptions_total is None


def test_by_reason_alone_is_not_waiting() -> None:
    text = (
        'vllm:num_requests_waiting_by_reason{model_name="m",reason="capacity"} 30\n'
        'vllm:kv_cache_usage_perc{model_name="m"} 0.1\n'
    )
    assert parse_metrics(text)["m"].requests_waiting is None


def test_sglang_tensor_ranks_are_not_double_counted() -> None:
    s = parse_metrics(page("sglang_tp2_dp2.txt"))["qwen-7b"]
    assert s.kind is ServerKind.SGLANG
    assert s.kv_usage == pytest.approx(0.73)
    assert s.requests_waiting == 5  # dp0: 2, dp1: 3; tp ranks repeat the same queue
    assert s.requests_running == 10
    assert s.preemptions_total == 7  # the counter, not the num_retracted_reqs gauge
    assert s.kv_capacity_tokens == 400_000


def test_sglang_cache_config_info_fallback() -> None:
    text = (
        'sglang:token_usage{model_name="x",tp_rank="0"} 0.25\n'
        'sglang:cache_config_info{model_name="x",num_pages="1000",page_size="1"} 1\n'
    )
    assert parse_metrics(text)["x"].kv_capacity_tokens == 1000


def test_tgi_proxy_with_model_override() -> None:
    out = parse_metrics(page("tgi.txt"), "tgi", model="mistral-7b")
    s = out["mistral-7b"]
    assert s.kv_usage == pytest.approx(98304 / 131072)
    assert (s.requests_waiting, s.requests_running) == (4, 16)
    assert s.kv_capacity_tokens == 131072
    assert s.preemptions_total is None


def test_tgi_without_model_name_uses_empty_name() -> None:
    assert list(parse_metrics(page("tgi.txt"))) == [""]


def test_triton_trtllm_backend() -> None:
    s = parse_metrics(page("triton_trtllm.txt"), model="llama")["llama"]
    assert s.kind is ServerKind.TRITON
    assert s.kv_usage == pytest.approx(0.5)
    assert (s.requests_waiting, s.requests_running) == (5, 9)  # scheduled, not active
    assert s.kv_capacity_tokens == 6000 * 64


def test_triton_model_label_is_used_without_override() -> None:
    assert list(parse_metrics(page("triton_trtllm.txt"))) == ["tensorrt_llm"]


def test_trtllm_serve() -> None:
    s = parse_metrics(page("trtllm_serve.txt"))["llama-3-70b"]
    assert s.kind is ServerKind.TRTLLM
    assert s.kv_usage == pytest.approx(0.71)
    assert (s.requests_waiting, s.requests_running) == (1, 22)
    assert s.kv_capacity_tokens == 4096 * 32


def test_two_models_on_one_page_and_unlabelled_info_applies_to_both() -> None:
    text = (
        'vllm:kv_cache_usage_perc{model_name="a"} 0.2\n'
        'vllm:kv_cache_usage_perc{model_name="b"} 0.9\n'
        'vllm:num_requests_waiting{model_name="b"} 7\n'
        'vllm:cache_config_info{block_size="16",num_gpu_blocks="100"} 1\n'
    )
    out = parse_metrics(text)
    assert out["a"].kv_usage == pytest.approx(0.2) and out["a"].requests_waiting is None
    assert out["b"].requests_waiting == 7
    assert out["a"].kv_capacity_tokens == out["b"].kv_capacity_tokens == 1600


def test_ratio_above_one_is_clamped_not_divided() -> None:
    assert parse_metrics('vllm:kv_cache_usage_perc{model_name="m"} 1.5\n')["m"].kv_usage == 1.0


@pytest.mark.parametrize(
    ("value", "unit", "expected"),
    [
        (45.0, "percent", 0.45),
        (0.45, "percent", 0.45),
        (100.0, "percent", 1.0),
        (0.3, "ratio", 0.3),
        (-2.0, "ratio", 0.0),
    ],
)
def test_normalize_usage(value: float, unit: str, expected: float) -> None:
    assert normalize_usage(value, unit) == pytest.approx(expected)  # type: ignore[arg-type]


def test_nan_usage_is_dropped() -> None:
    out = parse_metrics(
        'vllm:kv_cache_usage_perc{model_name="m"} NaN\nvllm:num_requests_waiting{model_name="m"} 1\n'
    )
    assert out["m"].kv_usage is None and out["m"].requests_waiting == 1


def test_labels_with_escapes_commas_and_timestamps() -> None:
    text = 'vllm:num_requests_waiting{model_name="a,\\"b\\"}",engine="0",} 3 1700000000000\n'
    [s] = parse_series(text)
    assert s.labels == {"model_name": 'a,"b"}', "engine": "0"}
    assert s.value == 3


@pytest.mark.parametrize("name", ["garbage_html.txt", "trtllm_json_iteration_stats.txt", "truncated.txt"])
def test_malformed_pages_raise_parse_error(name: str) -> None:
    with pytest.raises(MetricsParseError):
        parse_metrics(page(name))


@pytest.mark.parametrize(
    "text",
    [
        "",
        "# only comments\n",
        'foo{a="b"} not-a-number\n',
        "foo 1 2 3\n",
        "\x00\x01\x02",
        "process_cpu_seconds_total 12\n",  # no known prefix: cannot detect
    ],
)
def test_more_malformed(text: str) -> None:
    with pytest.raises(MetricsParseError):
        parse_metrics(text)


def test_wrong_kind_raises() -> None:
    with pytest.raises(MetricsParseError, match="no sglang metrics"):
        parse_metrics(page("vllm_v1_dp2.txt"), ServerKind.SGLANG)


@given(st.text(max_size=300))
def test_never_raises_anything_but_parse_error(text: str) -> None:
    with contextlib.suppress(MetricsParseError):
        parse_metrics(text)


def test_docs_table_lists_every_metric_name() -> None:
    docs = DOCS.read_text()
    table_names = set(re.findall(r"`([a-zA-Z_:][a-zA-Z0-9_:]*)", docs))
    missing = {row.name for row in METRIC_TABLE} - table_names
    assert not missing, f"docs/feedback.md misses {sorted(missing)}"
