"""Drive the ext_proc servicer over a real gRPC channel as Envoy does: the messages Envoy sends, one stream,
and a harness that reads the sidecar's own metrics."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Mapping
from typing import Any

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from prometheus_client.parser import text_string_to_metric_families

from extproc.app import Sidecar
from extproc.config import parse_config
from extproc.core.clock import FakeClock
from extproc.metrics import Metrics
from tests.support.waiting import eventually

BASE_CONFIG: dict[str, Any] = {
    "server": {"grpc_listen": "127.0.0.1:0", "admin_listen": "127.0.0.1:0"},
    "admission": {"max_body_bytes": 4096, "tenant": {"header": "x-tenant"}},
    "models": {"*": {"context_window": 1000, "default_max_tokens": 100}},
    "limits": {
        "global": {"max_concurrency": 2, "tokens_per_minute": 6000},
        "tenants": {"small": {"tokens_per_minute": 600}},
    },
}


def _http_headers(items: dict[str, str], eos: bool) -> pb.HttpHeaders:
    """Headers as Envoy 1.40 sends them: values in raw_value."""
    return pb.HttpHeaders(
        headers=base_pb2.HeaderMap(
            headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in items.items()]
        ),
        end_of_stream=eos,
    )


def headers_msg(
    method: str, path: str, eos: bool = False, headers: Mapping[str, str] | None = None
) -> pb.ProcessingRequest:
    """Request headers as Envoy sends them: the pseudo-headers plus `headers` (a mapping, not keywords: header
    names have hyphens, and keywords would share a namespace with `eos`)."""
    items = {":method": method, ":path": path, ":authority": "gw", **(headers or {})}
    return pb.ProcessingRequest(request_headers=_http_headers(items, eos))


def body_msg(body: bytes, eos: bool = True) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=eos))


def resp_headers_msg(
    status: int, content_type: str, eos: bool = False, from_router: bool = True
) -> pb.ProcessingRequest:
    """Response headers as ext_proc sees them: an upstream answer carries what Envoy's router adds to it."""
    items = {":status": str(status), "content-type": content_type}
    if from_router:
        items["x-envoy-upstream-service-time"] = "3"
    return pb.ProcessingRequest(response_headers=_http_headers(items, eos))


def resp_body_msg(body: bytes, eos: bool = False) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(response_body=pb.HttpBody(body=body, end_of_stream=eos))


def chat(max_tokens: int = 50, stream: bool = False, content: str = "hello there") -> bytes:
    body: dict[str, Any] = {
        "model": "m",
        "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": content}],
    }
    if stream:
        body["stream"] = True
    return json.dumps(body).encode()


def header_map(mutation: pb.HeaderMutation) -> dict[str, str]:
    return {h.header.key: h.header.raw_value.decode() for h in mutation.set_headers}


class Stream:
    """One ext_proc stream: send a message, read the reply, like Envoy does."""

    def __init__(self, stub: pb_grpc.ExternalProcessorStub) -> None:
        self.call = stub.Process()

    async def send(self, message: pb.ProcessingRequest) -> pb.ProcessingResponse:
        await self.call.write(message)
        response = await asyncio.wait_for(self.call.read(), 10)
        assert response is not grpc.aio.EOF
        return response

    async def close(self) -> None:
        await self.call.done_writing()

    def cancel(self) -> None:
        self.call.cancel()


class Harness:
    def __init__(self, sidecar: Sidecar, channel: grpc.aio.Channel) -> None:
        self.sidecar = sidecar
        self.stub = pb_grpc.ExternalProcessorStub(channel)

    def stream(self) -> Stream:
        return Stream(self.stub)

    def metric(self, name: str, **labels: str) -> float:
        families = text_string_to_metric_families(
            __import__("prometheus_client").generate_latest(self.sidecar.metrics.registry).decode()
        )
        for family in families:
            for sample in family.samples:
                if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                    return float(sample.value)
        return 0.0

    async def settled(self) -> None:
        """Wait until no lease is open and every settlement has been accounted."""
        await eventually(lambda: self.metric("extproc_active_requests") == 0)
        await self.sidecar.admission.drain()


@contextlib.asynccontextmanager
async def serving(config: dict[str, Any]) -> AsyncIterator[tuple[Sidecar, grpc.aio.Channel]]:
    """A sidecar started on `config` with a fake clock, and a channel to its ext_proc port; both closed
    after (the sidecar given 1 s to drain)."""
    sidecar = Sidecar(config=parse_config(config), clock=FakeClock(), metrics=Metrics())
    await sidecar.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{sidecar.grpc_port}")
    try:
        yield sidecar, channel
    finally:
        await channel.close()
        await sidecar.stop(grace_s=1)
