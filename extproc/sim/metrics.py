"""Prometheus metrics named, typed and labelled as vLLM V1 exposes them (`vllm/v1/metrics/loggers.py`, 0.33).

The sidecar and its exporter scrape these exact names, so they follow vLLM's PrometheusStatLogger:
labels `model_name` (served name) and `engine` (data-parallel index, "0" here); counters are created
without the `_total` suffix and prometheus_client appends it. A dedicated CollectorRegistry keeps several
in-process simulators (tests, benchmarks) from colliding in the global registry.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

__all__ = ["CONTENT_TYPE_LATEST", "EngineMetrics", "LegacyKvMetric"]

FINISH_REASONS = ("stop", "length", "abort")
ADMISSION_REASONS = ("max_num_queued_reqs", "max_num_queued_tokens")  # vllm/v1/metrics/loggers.py

# Bucket edges as in vLLM's loggers.py, so histogram_quantile behaves the same on both.
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
    40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip


class LegacyKvMetric(enum.StrEnum):
    """Whether to expose the pre-0.9 KV gauge `vllm:gpu_cache_usage_perc` (removed upstream in late 2025)."""

    OFF = "off"  # only vllm:kv_cache_usage_perc (current vLLM)
    ALSO = "also"  # both names, as vLLM 0.9-0.11 did during the deprecation window
    INSTEAD = "instead"  # only the legacy name, as vLLM V0 / <= 0.8


class EngineMetrics:
    """All series of one simulated engine; latencies are observed in engine (modelled) seconds."""

    def __init__(
        self,
        model_name: str,
        cache_info: Mapping[str, str],
        legacy_kv: LegacyKvMetric = LegacyKvMetric.OFF,
        engine: str = "0",
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ["model_name", "engine"]
        values = (model_name, engine)
        r = self.registry

        self.running = Gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches.", labels, registry=r
        ).labels(*values)
        self.waiting = Gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed.", labels, registry=r
        ).labels(*values)
        self._kv_gauges = []
        if legacy_kv is not LegacyKvMetric.INSTEAD:
            self._kv_gauges.append(
                Gauge(
                    "vllm:kv_cache_usage_perc",
                    "KV-cache usage. 1 means 100 percent usage.",
                    labels,
                    registry=r,
                ).labels(*values)
            )
        if legacy_kv is not LegacyKvMetric.OFF:
            # vLLM <= 0.8 help text; 0.9-0.11 append the deprecation note without a space.
            legacy_help = "GPU KV-cache usage. 1 means 100 percent usage."
            if legacy_kv is LegacyKvMetric.ALSO:
                legacy_help += "DEPRECATED: Use vllm:kv_cache_usage_perc instead."
            self._kv_gauges.append(
                Gauge("vllm:gpu_cache_usage_perc", legacy_help, labels, registry=r).labels(*values)
            )
        self.preemptions = Counter(
            "vllm:num_preemptions", "Cumulative number of preemption from the engine.", labels, registry=r
        ).labels(*values)
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", labels, registry=r
        ).labels(*values)
        # Prefix cache (loggers.py): queried and hit tokens of new requests, booked at their admission;
        # cached prompt tokens booked with the prompt tokens, at the first token.
        self.prefix_cache_queries = Counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            labels,
            registry=r,
        ).labels(*values)
        self.prefix_cache_hits = Counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            labels,
            registry=r,
        ).labels(*values)
        self.prompt_tokens_cached = Counter(
            "vllm:prompt_tokens_cached",
            "Number of cached prompt tokens (local + external).",
            labels,
            registry=r,
        ).labels(*values)
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Number of generation tokens processed.", labels, registry=r
        ).labels(*values)
        success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*labels, "finished_reason"],
            registry=r,
        )
        self.request_success = {reason: success.labels(*values, reason) for reason in FINISH_REASONS}
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            labels,
            buckets=TTFT_BUCKETS,
            registry=r,
        ).labels(*values)
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            labels,
            buckets=ITL_BUCKETS,
            registry=r,
        ).labels(*values)
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            labels,
            buckets=REQUEST_LATENCY_BUCKETS,
            registry=r,
        ).labels(*values)
        self.queue_time = Histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            labels,
            buckets=REQUEST_LATENCY_BUCKETS,
            registry=r,
        ).labels(*values)
        info_labels = {**cache_info, "engine": engine}
        Gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            list(info_labels),
            registry=r,
        ).labels(**info_labels).set(1)
        # Frontend admission (loggers.py): labelled by model and reason only, no engine index.
        rejections = Counter(
            "vllm:admission_rejections",
            "Number of admission attempts rejected by a queue limit, by reason.",
            ["model_name", "reason"],
            registry=r,
        )
        self.admission_rejections = {
            reason: rejections.labels(model_name, reason) for reason in ADMISSION_REASONS
        }
        self.oom_events = Counter(
            "sim_oom_events",
            "Engine crashes because a running sequence found no free KV block (overflow=oom).",
            labels,
            registry=r,
        ).labels(*values)

    def set_state(self, running: int, waiting: int, kv_usage: float) -> None:
        """Scheduler gauges, set once per step as vLLM does from SchedulerStats."""
        self.running.set(running)
        self.waiting.set(waiting)
        for gauge in self._kv_gauges:
            gauge.set(kv_usage)

    def render(self) -> bytes:
        return generate_latest(self.registry)
