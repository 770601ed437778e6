"""The exporter against fake inference servers, over a real gRPC channel."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from extproc.kvfeed.engines import ServerKind
from extproc.kvfeed.exporter.app import SERVICE_NAME, Exporter, ExporterConfig
from extproc.kvfeed.exporter.discovery import KubeDiscoveryConfig
from extproc.kvfeed.proto import feedback_pb2, feedback_pb2_grpc
from extproc.kvfeed.sample import FeedSample, from_proto
from extproc.kvfeed.targets import Target

from .fakes import FakeInferenceServer, FakeKubeApi, eventually, pod

MODEL = "meta-llama/Llama-3.1-8B-Instruct"


def config(**kw: object) -> ExporterConfig:
    base: dict[str, object] = {
        "node_name": "gpu-node-1",
        "grpc_host": "127.0.0.1",
        "grpc_port": 0,
        "metrics_host": "127.0.0.1",
        "metrics_port": 0,
        "scrape_interval": 0.1,
        "scrape_timeout": 0.3,
    }
    base.update(kw)
    return ExporterConfig(**base)  # type: ignore[arg-type]


@contextlib.asynccontextmanager
async def running(cfg: ExporterConfig) -> AsyncIterator[Exporter]:
    exporter = Exporter(cfg)
    await exporter.start()
    try:
        yield exporter
    finally:
        await exporter.stop()


class Watcher:
    """Reads a Watch stream in the background into a list."""

    def __init__(self, port: int, models: list[str] | None = None) -> None:
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        self.stub = feedback_pb2_grpc.KvFeedStub(self.channel)  # type: ignore[no-untyped-call]
        self.samples: list[FeedSample] = []
        self._task = asyncio.create_task(self._run(models or []))

    async def _run(self, models: list[str]) -> None:
        call = self.stub.Watch(feedback_pb2.WatchRequest(models=models))
        async for msg in call:
            self.samples.append(from_proto(msg))

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
            await self._task
        await self.channel.close()


async def test_subscribers_receive_samples_and_down_targets(vllm: FakeInferenceServer) -> None:
    async with running(config(targets=[Target(vllm.url, ServerKind.VLLM)])) as exporter:
        first = Watcher(exporter.grpc_port)
        second = Watcher(exporter.grpc_port)
        try:
            await eventually(lambda: len(first.samples) >= 2 and len(second.samples) >= 2)
            s = first.samples[0]
            assert (s.node, s.endpoint, s.model) == ("gpu-node-1", f"127.0.0.1:{vllm.port}", MODEL)
            assert s.up and s.server_kind is ServerKind.VLLM
            assert s.kv_usage == pytest.approx(0.81)
            assert (s.requests_waiting, s.requests_running, s.preemptions_total) == (4, 12, 16)
            assert s.kv_capacity_tokens == 2 * 237_792
            assert s.sample_time > 1e9

            for mode, reason in (("garbage", "parse"), ("500", "http_status"), ("timeout", "timeout")):
                vllm.mode = mode  # type: ignore[assignment]

                def newest_down(reason: str = reason) -> FeedSample | None:
                    return next(
                        (x for x in reversed(second.samples) if not x.up and x.error.startswith(reason)), None
                    )

                down = await eventually(newest_down)
                assert down.model == MODEL  # reported against the model seen before
                assert down.kv_usage is None
            vllm.mode = "ok"
            await eventually(lambda: first.samples[-1].up)
        finally:
            await first.close()
            await second.close()

        url = f"http://127.0.0.1:{exporter.metrics_port}/metrics"
        async with aiohttp.ClientSession() as http, http.get(url) as resp:
            text = await resp.text()
        values = {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text)
            for s in fam.samples
        }
        target = f"127.0.0.1:{vllm.port}"
        for reason in ("parse", "http_status", "timeout"):
            key = ("extproc_exporter_scrape_errors_total", (("reason", reason), ("target", target)))
            assert values[key] >= 1
        assert values[("extproc_exporter_targets_up", ())] in (0.0, 1.0)
        assert values[("extproc_exporter_scrape_duration_seconds_count", (("target", target),))] > 3
        assert ("extproc_exporter_subscribers", ()) in values


async def test_new_subscriber_gets_newest_sample_at_once_and_model_filter(vllm: FakeInferenceServer) -> None:
    async with running(config(targets=[Target(vllm.url)], scrape_interval=5.0)) as exporter:
        await eventually(lambda: exporter.hub.latest())
        hits = vllm.hits
        w = Watcher(exporter.grpc_port, models=[MODEL])
        other = Watcher(exporter.grpc_port, models=["nope"])
        try:
            await eventually(lambda: w.samples)
            assert vllm.hits == hits  # served from the cache, no new scrape needed
            assert exporter.metrics.subscribers._value.get() == 2
            await asyncio.sleep(0.2)
            assert other.samples == []
        finally:
            await w.close()
            await other.close()
        await eventually(lambda: exporter.hub.subscribers == 0)


async def test_health_serving_then_not_serving_on_stop(vllm: FakeInferenceServer) -> None:
    exporter = Exporter(config(targets=[Target(vllm.url)]))
    await exporter.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{exporter.grpc_port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        resp = await stub.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME))
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
    await exporter.stop()
    await exporter.stop()  # idempotent


async def test_kubernetes_discovery_against_fake_api(vllm: FakeInferenceServer, tmp_path: Path) -> None:
    api = FakeKubeApi()
    await api.start()
    token = tmp_path / "token"
    token.write_text("secret-token\n")
    api.pods = [
        pod("vllm-0", "gpu-node-1", "127.0.0.1", annotations={"extproc.io/metrics-port": str(vllm.port)}),
        pod("vllm-other-node", "gpu-node-2", "127.0.0.2"),
        pod("vllm-pending", "gpu-node-1", "127.0.0.3", phase="Pending"),
    ]
    kube = KubeDiscoveryConfig(
        label_selector="app=vllm",
        node_name="gpu-node-1",
        api_url=api.url,
        default_port=1,
        default_kind="vllm",
        token_path=token,
        ca_path=None,
        relist_seconds=0.2,
    )
    try:
        async with running(config(kube=kube)) as exporter:
            assert [t.url for t in exporter.targets] == [vllm.url]
            assert api.queries[0] == {
                "labelSelector": "app=vllm",
                "fieldSelector": "spec.nodeName=gpu-node-1",
            }
            assert api.auth[0] == "Bearer secret-token"
            w = Watcher(exporter.grpc_port)
            try:
                await eventually(lambda: any(s.up and s.model == MODEL for s in w.samples))
                # The API server fails: the last good list is kept.
                api.fail = True
                n = len(api.queries)
                await eventually(lambda: len(api.queries) > n + 1)
                assert [t.url for t in exporter.targets] == [vllm.url]
                assert exporter.metrics.discovery_errors._value.get() >= 1
                # The pod goes away: a final down sample, then the target is dropped.
                api.fail = False
                api.pods = api.pods[1:]
                await eventually(lambda: exporter.targets == [])
                await eventually(lambda: any(not s.up and s.error == "target removed" for s in w.samples))
                assert exporter.hub.latest() == []
            finally:
                await w.close()
    finally:
        await api.stop()


def test_config_requires_targets() -> None:
    with pytest.raises(ValueError, match="targets"):
        ExporterConfig(node_name="n")
