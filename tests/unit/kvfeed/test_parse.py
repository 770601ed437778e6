"""Engine-independent behaviour of the metrics-page parser: exact names, units, escapes, bad input.

Engine pages and the numbers they must yield are in test_engine_fixtures.py.
"""

from __future__ import annotations

import contextlib
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from extproc.kvfeed.engines import ServerKind
from extproc.kvfeed.parse import MetricsParseError, normalize_usage, parse_metrics, parse_series
from tests.support.metric_pages import page


def test_vllm_prefers_current_kv_name_over_deprecated() -> None:
    text = (
        'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5\n'
        'vllm:gpu_cache_usage_perc{engine="0",model_name="m"} 0.99\n'
    )
    assert parse_metrics(text)["m"].kv_usage == pytest.approx(0.5)
    legacy_only = 'vllm:gpu_cache_usage_perc{engine="0",model_name="m"} 0.99\n'
    assert parse_metrics(legacy_only)["m"].kv_usage == pytest.approx(0.99)


def test_vllm_mean_aggregation_is_over_engines() -> None:
    out = parse_metrics(page("vllm_0.33.0_dp2.txt"), kv_aggregation="mean")
    assert out["meta-llama/Llama-3.1-8B-Instruct"].kv_usage == pytest.approx((0.62 + 0.81) / 2)


def test_by_reason_alone_is_not_waiting() -> None:
    text = (
        'vllm:num_requests_waiting_by_reason{model_name="m",reason="capacity"} 30\n'
        'vllm:kv_cache_usage_perc{model_name="m"} 0.1\n'
    )
    assert parse_metrics(text)["m"].requests_waiting is None


def test_vllm_capacity_label_none_falls_back_to_geometry() -> None:
    """vLLM writes unset CacheConfig fields as "None"; that is unknown, not zero."""
    text = (
        'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.1\n'
        'vllm:cache_config_info{block_size="16",engine="0",kv_cache_size_tokens="None",'
        'num_gpu_blocks="100"} 1\n'
    )
    assert parse_metrics(text)["m"].kv_capacity_tokens == 1600
    unknown = text.replace('num_gpu_blocks="100"', 'num_gpu_blocks="None"')
    assert parse_metrics(unknown)["m"].kv_capacity_tokens is None


def test_sglang_info_gauge_is_a_fallback_not_an_addition() -> None:
    """0.5.10 sets max_total_num_tokens only with the first stats; before that the info gauge says it."""
    text = (
        'sglang:token_usage{model_name="x",tp_rank="0"} 0.25\n'
        'sglang:cache_config_info{num_pages="1000",page_size="1"} 1\n'
    )
    assert parse_metrics(text)["x"].kv_capacity_tokens == 1000
    both = text + 'sglang:max_total_num_tokens{model_name="x",tp_rank="0"} 1000\n'
    assert parse_metrics(both)["x"].kv_capacity_tokens == 1000


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
        (-2.0, "ratio", math.nan),
        (math.inf, "percent", math.nan),
    ],
)
def test_normalize_usage(value: float, unit: str, expected: float) -> None:
    assert normalize_usage(value, unit) == pytest.approx(expected, nan_ok=True)  # type: ignore[arg-type]


def test_nan_usage_is_kept_for_the_sample_check_to_refuse() -> None:
    out = parse_metrics(
        'vllm:kv_cache_usage_perc{model_name="m"} NaN\nvllm:num_requests_waiting{model_name="m"} 1\n'
    )
    kv = out["m"].kv_usage
    assert kv is not None and math.isnan(kv) and out["m"].requests_waiting == 1


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
        parse_metrics(page("vllm_0.33.0_dp2.txt"), ServerKind.SGLANG)


@given(st.text(max_size=300))
def test_never_raises_anything_but_parse_error(text: str) -> None:
    with contextlib.suppress(MetricsParseError):
        parse_metrics(text)


def test_vllm_block_size_reaches_the_signals() -> None:
    """The engine rounds each sequence to whole blocks; the budget books that from `block_size`."""
    text = (
        'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.1\n'
        'vllm:cache_config_info{block_size="128",engine="0",num_gpu_blocks="128"} 1\n'
    )
    assert parse_metrics(text)["m"].kv_block_tokens == 128
    unknown = text.replace('block_size="128"', 'block_size="None"')
    assert parse_metrics(unknown)["m"].kv_block_tokens is None
    gauge_only = (
        'sglang:token_usage{model_name="x",tp_rank="0"} 0.25\n'
        'sglang:max_total_num_tokens{model_name="x",tp_rank="0"} 1000\n'
    )
    assert parse_metrics(gauge_only)["x"].kv_block_tokens is None


def test_vllm_says_whether_it_shares_prompt_prefixes() -> None:
    """vllm 0.32.0 labels vllm:cache_config_info with every CacheConfig field as str(value), among them
    enable_prefix_caching: "False" means no prompt shares another's blocks, and one engine of the page that
    says so is enough."""
    text = (
        'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.1\n'
        'vllm:cache_config_info{block_size="16",enable_prefix_caching="True",engine="0",'
        'num_gpu_blocks="128"} 1\n'
    )
    assert parse_metrics(text)["m"].prefix_caching is True
    assert parse_metrics(text.replace('"True"', '"False"'))["m"].prefix_caching is False
    second = (
        'vllm:cache_config_info{block_size="16",enable_prefix_caching="False",engine="1",'
        'num_gpu_blocks="128"} 1\n'
    )
    assert parse_metrics(text + second)["m"].prefix_caching is False
    assert parse_metrics(text.replace('enable_prefix_caching="True",', ""))["m"].prefix_caching is None


def test_vllm_admission_rejections_are_summed_over_reasons() -> None:
    """vLLM 0.32.0's counter (vllm/v1/metrics/loggers.py): labels model_name and reason only, one series per
    queue bound; the feed publishes their sum, and nothing where the page has none (before 0.32)."""
    text = (
        'vllm:num_requests_running{engine="0",model_name="m"} 2.0\n'
        'vllm:admission_rejections_total{model_name="m",reason="max_num_queued_reqs"} 3.0\n'
        'vllm:admission_rejections_created{model_name="m",reason="max_num_queued_reqs"} 1.7e9\n'
        'vllm:admission_rejections_total{model_name="m",reason="max_num_queued_tokens"} 2.0\n'
    )
    assert parse_metrics(text)["m"].admission_rejections_total == 5.0
    older = 'vllm:num_requests_running{engine="0",model_name="m"} 2.0\n'
    assert parse_metrics(older)["m"].admission_rejections_total is None
