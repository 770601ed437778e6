"""Series the dashboard needs that no component exported before: per-server KV usage and store health."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from extproc.app import Sidecar
from extproc.config import parse_config
from extproc.kvfeed.engines import ServerKind
from extproc.kvfeed.exporter.metrics import ExporterMetrics
from extproc.kvfeed.sample import FeedSample
from extproc.metrics import Metrics

USAGE = "extproc_exporter_kv_usage_ratio"


def up(endpoint: str, model: str, usage: float) -> FeedSample:
    return FeedSample(
        node="gpu-1",
        endpoint=endpoint,
        model=model,
        server_kind=ServerKind.VLLM,
        kv_usage=usage,
        requests_waiting=0,
        requests_running=1,
        preemptions_total=0,
        kv_capacity_tokens=4096,
        sample_time=1.0,
        up=True,
    )


def test_exporter_exports_kv_usage_per_server_and_drops_down_or_departed_ones() -> None:
    registry = CollectorRegistry()
    metrics = ExporterMetrics(registry)
    metrics.observe_samples([up("10.0.0.1:8000", "llama", 0.4), up("10.0.0.2:8000", "llama", 0.9)])

    def usage(endpoint: str) -> float | None:
        labels = {"node": "gpu-1", "endpoint": endpoint, "model": "llama"}
        return registry.get_sample_value(USAGE, labels)

    assert usage("10.0.0.1:8000") == 0.4
    assert usage("10.0.0.2:8000") == 0.9

    down = FeedSample.down("gpu-1", "10.0.0.1:8000", "llama", ServerKind.VLLM, "timeout", 2.0)
    metrics.observe_samples([down])
    assert usage("10.0.0.1:8000") is None  # a down server has no usage, not a stale one
    metrics.forget_target("10.0.0.2:8000")
    assert usage("10.0.0.2:8000") is None


def store_series(sidecar: Sidecar) -> dict[str, float | None]:
    registry = sidecar.metrics.registry
    names = (
        "extproc_store_available",
        "extproc_store_fallback_acquires_total",
        "extproc_store_fallback_leases",
        "extproc_store_lost_leases_total",
        "extproc_store_dropped_releases_total",
    )
    return {name: registry.get_sample_value(name) for name in names}


def test_in_process_store_exports_healthy_zeros() -> None:
    sidecar = Sidecar(config=parse_config({}), metrics=Metrics())
    assert store_series(sidecar) == {
        "extproc_store_available": 1.0,
        "extproc_store_fallback_acquires_total": 0.0,
        "extproc_store_fallback_leases": 0.0,
        "extproc_store_lost_leases_total": 0.0,
        "extproc_store_dropped_releases_total": 0.0,
    }


async def test_unreachable_redis_shows_as_unavailable_with_fallback_admissions(tmp_path: Path) -> None:
    # Nothing listens on a Unix socket path that does not exist: every call fails at once.
    url = f"unix://{tmp_path / 'no-redis.sock'}"
    config = parse_config({"store": {"backend": "redis", "redis": {"url": url}, "on_unavailable": "local"}})
    sidecar = Sidecar(config=config, metrics=Metrics())
    assert sidecar.store is not None
    await sidecar.store.apply_limits({}, {}, ())
    await sidecar.store.acquire(["global"], 10)
    await sidecar.store.acquire(["global"], 10)
    series = store_series(sidecar)
    assert series["extproc_store_available"] == 0.0
    assert series["extproc_store_fallback_acquires_total"] == 2.0
    assert series["extproc_store_fallback_leases"] == 2.0  # running uncounted in Redis until it answers
    close = getattr(sidecar.store, "close", None)
    if close is not None:
        await close()
    sidecar.executor.shutdown(wait=False)


async def test_token_counters_of_every_model_label_start_at_zero() -> None:
    config = parse_config({"models": {"*": {"context_window": 4096}, "llama": {"context_window": 8192}}})
    sidecar = Sidecar(config=config, metrics=Metrics())
    await sidecar.apply_config(config)
    registry = sidecar.metrics.registry
    for model in ("llama", "other"):
        for name in ("reserved", "refunded", "overrun"):
            assert registry.get_sample_value(f"extproc_tokens_{name}_total", {"model": model}) == 0.0
        for kind in ("prompt", "completion"):
            labels = {"model": model, "kind": kind}
            assert registry.get_sample_value("extproc_tokens_settled_total", labels) == 0.0
        refusals = {"model": model, "reason": "queue_full"}
        assert registry.get_sample_value("extproc_engine_refusals_total", refusals) == 0.0
    assert registry.get_sample_value("extproc_tokens_reserved_total", {"model": "*"}) is None
    sidecar.executor.shutdown(wait=False)


async def test_scale_floor_of_each_adaptive_pool_follows_the_config() -> None:
    data: dict[str, Any] = {
        "server": {"grpc_listen": "127.0.0.1:0", "admin_listen": "127.0.0.1:0"},
        "limits": {"models": {"llama": {"max_concurrency": 4}, "mistral": {"max_concurrency": 4}}},
        "feedback": {"exporters": ["127.0.0.1:9"]},  # nothing listens: the feed stays stale
        "adaptive": {"min_scale": 0.5, "pools": {"mistral": {"min_scale": 0.25}}},
    }
    sidecar = Sidecar(config=parse_config(data), metrics=Metrics())
    await sidecar.start()
    try:
        registry = sidecar.metrics.registry

        def floor(pool: str) -> float | None:
            return registry.get_sample_value("extproc_adaptive_min_scale_ratio", {"pool": pool})

        assert (floor("llama"), floor("mistral")) == (0.5, 0.25)
        await sidecar.apply_config(parse_config({**data, "feedback": {}, "adaptive": {}}))
        assert (floor("llama"), floor("mistral")) == (None, None)
    finally:
        await sidecar.stop(grace_s=0)
