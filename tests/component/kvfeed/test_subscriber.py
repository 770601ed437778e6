"""Sidecar subscriber and FeedbackLoop against real exporters over gRPC: restarts and staleness."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from devstack.processes import free_port
from extproc.core.engine.adaptive import AdaptiveConfig, ControllerState
from extproc.kvfeed.exporter.app import Exporter, ExporterConfig
from extproc.kvfeed.subscriber.client import FeedSubscriber
from extproc.kvfeed.subscriber.loop import FeedbackLoop
from extproc.kvfeed.subscriber.metrics import register_feedback_metrics
from extproc.kvfeed.subscriber.settings import SubscriberConfig
from extproc.kvfeed.targets import Target

from .fakes import FakeInferenceServer, eventually

MODEL = "meta-llama/Llama-3.1-8B-Instruct"


def exporter_for(server: FakeInferenceServer, port: int, node: str = "gpu-1") -> Exporter:
    return Exporter(
        ExporterConfig(
            node_name=node,
            targets=[Target(server.url)],
            grpc_host="127.0.0.1",
            grpc_port=port,
            metrics_port=None,
            scrape_interval=0.1,
            scrape_timeout=0.5,
            shutdown_grace=0.1,
        )
    )


FAST = {"backoff_initial": 0.05, "backoff_max": 0.2, "idle_timeout": 2.0}


async def test_reconnects_after_exporter_restart(vllm: FakeInferenceServer) -> None:
    port = free_port()
    exporter = exporter_for(vllm, port)
    await exporter.start()
    sub = FeedSubscriber(SubscriberConfig(exporters=(f"127.0.0.1:{port}",), **FAST))  # type: ignore[arg-type]
    await sub.start()
    try:
        await eventually(lambda: sub.samples())
        await exporter.stop()
        await eventually(lambda: sub.reconnects >= 1)
        before = sub.samples_received
        exporter = exporter_for(vllm, port)
        await exporter.start()
        await eventually(lambda: sub.samples_received > before + 2)
        assert f"127.0.0.1:{port}" in sub.connected
        assert sub.samples()[0].sample.model == MODEL
    finally:
        await sub.stop()
        await exporter.stop()


async def test_loop_goes_stale_when_exporter_dies_and_recovers(vllm: FakeInferenceServer) -> None:
    port = free_port()
    exporter = exporter_for(vllm, port)
    await exporter.start()
    updates: list[tuple[str, ControllerState]] = []
    registry = CollectorRegistry()
    loop = FeedbackLoop(
        SubscriberConfig(exporters=(f"127.0.0.1:{port}",), **FAST),  # type: ignore[arg-type]
        {MODEL: AdaptiveConfig(stale_after_seconds=0.6, recovery_per_second=10.0)},
        on_update=lambda pool, state: updates.append((pool, state)),
        metrics=register_feedback_metrics(registry),
        tick_interval=0.05,
    )
    await loop.start()
    try:
        # kv 0.81 -> scale 1 - 0.4 * 0.11 / 0.15
        expected = 1 - 0.4 * (0.81 - 0.70) / 0.15
        await eventually(lambda: loop.states()[MODEL].scale == pytest.approx(expected))
        assert not loop.states()[MODEL].stale
        assert loop.capacity_tokens(MODEL) == 2 * 237_792
        assert registry.get_sample_value("extproc_adaptive_scale_ratio", {"pool": MODEL}) == pytest.approx(
            expected
        )
        assert registry.get_sample_value("extproc_kv_capacity_tokens", {"pool": MODEL}) == 2 * 237_792
        assert (registry.get_sample_value("extproc_feed_samples_total") or 0) > 0

        await exporter.stop()
        await eventually(lambda: loop.states()[MODEL].stale)  # detected by the tick, no sample needed
        assert loop.states()[MODEL].scale == pytest.approx(0.6)
        assert registry.get_sample_value("extproc_feed_stale", {"pool": MODEL}) == 1.0
        assert (registry.get_sample_value("extproc_feed_reconnects_total") or 0) >= 1

        exporter = exporter_for(vllm, port)
        await exporter.start()
        await eventually(lambda: not loop.states()[MODEL].stale)
        assert any(pool == MODEL and state.stale for pool, state in updates)
    finally:
        await loop.stop()
        await exporter.stop()


async def test_service_name_resolution_and_direct_scraping(vllm: FakeInferenceServer) -> None:
    port = free_port()
    exporter = exporter_for(vllm, port)
    await exporter.start()
    resolved: list[str] = []

    async def resolver(host: str, p: int) -> list[str]:
        resolved.append(host)
        return [f"127.0.0.1:{p}"]

    sub = FeedSubscriber(
        SubscriberConfig(service=f"exporters.llm.svc:{port}", resolve_interval=0.1, **FAST),  # type: ignore[arg-type]
        resolver=resolver,
    )
    direct = FeedSubscriber(
        SubscriberConfig(direct_targets=(Target(vllm.url),), scrape_interval=0.1, direct_node="here")
    )
    await sub.start()
    await direct.start()
    try:
        await eventually(lambda: sub.samples())
        assert resolved[0] == "exporters.llm.svc"
        assert sub.addresses == [f"127.0.0.1:{port}"]
        await eventually(lambda: direct.samples())
        assert direct.samples()[0].sample.node == "here"
    finally:
        await sub.stop()
        await direct.stop()
        await exporter.stop()
