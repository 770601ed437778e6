"""Test doubles: an inference server serving canned metric pages and a tiny Kubernetes API server."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any, Literal

from aiohttp import web

from tests.support.metric_pages import page

Mode = Literal["ok", "garbage", "timeout", "500"]


class _HttpServer:
    def __init__(self) -> None:
        self.app = web.Application()
        self._runner: web.AppRunner | None = None
        self.port = 0

    async def start(self) -> None:
        self._runner = web.AppRunner(self.app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = self._runner.addresses[0][1]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


class FakeInferenceServer(_HttpServer):
    """Serves `page` at `path` (default /metrics); `mode` switches to garbage, a hang, or HTTP 500.

    `models` is served as an OpenAI model list at /v1/models (HTTP 404 when None), as vLLM, TGI and
    trtllm-serve do: names, or whole cards (`{"id", "root", "parent"}`, vLLM's ModelCard fields);
    `model_list_hits` counts the requests.
    """

    def __init__(
        self, page: str, path: str = "/metrics", models: list[str] | list[dict[str, Any]] | None = None
    ) -> None:
        super().__init__()
        self.page = page
        self.path = path
        self.models = models
        self.mode: Mode = "ok"
        self.hits = 0
        self.model_list_hits = 0
        self._release = asyncio.Event()
        self.app.router.add_get(path, self._metrics)
        self.app.router.add_get("/v1/models", self._model_list)

    async def stop(self) -> None:
        self._release.set()  # hanging handlers return so shutdown does not wait for them
        await super().stop()

    @classmethod
    def from_file(
        cls, name: str, path: str = "/metrics", models: list[str] | list[dict[str, Any]] | None = None
    ) -> FakeInferenceServer:
        return cls(page(name), path, models)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}{self.path}"

    async def _model_list(self, request: web.Request) -> web.Response:
        self.model_list_hits += 1
        if self.models is None:
            return web.Response(status=404, text="Not Found")
        data = [
            {"object": "model", "created": 0, "owned_by": "fake", **(m if isinstance(m, dict) else {"id": m})}
            for m in self.models
        ]
        return web.json_response({"object": "list", "data": data})

    async def _metrics(self, request: web.Request) -> web.StreamResponse:
        self.hits += 1
        if self.mode == "timeout":
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._release.wait(), 30)
        if self.mode == "500":
            return web.Response(status=500, text="internal error")
        if self.mode == "garbage":
            return web.Response(text="<html><body>oops</body></html>", content_type="text/html")
        return web.Response(text=self.page, content_type="text/plain")


class FakeKubeApi(_HttpServer):
    """`GET /api/v1/pods`: returns `pods` filtered by the node field selector; records the queries."""

    def __init__(self) -> None:
        super().__init__()
        self.pods: list[dict[str, Any]] = []
        self.queries: list[dict[str, str]] = []
        self.auth: list[str] = []
        self.fail = False
        self.app.router.add_get("/api/v1/pods", self._pods)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _pods(self, request: web.Request) -> web.Response:
        self.queries.append(dict(request.query))
        self.auth.append(request.headers.get("Authorization", ""))
        if self.fail:
            return web.json_response({"kind": "Status", "code": 500}, status=500)
        node = request.query.get("fieldSelector", "").removeprefix("spec.nodeName=")
        items = [p for p in self.pods if p["spec"]["nodeName"] == node]
        return web.json_response({"kind": "PodList", "apiVersion": "v1", "items": items})


def pod(
    name: str, node: str, ip: str, *, annotations: dict[str, str] | None = None, phase: str = "Running"
) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": "llm", "annotations": annotations or {}},
        "spec": {"nodeName": node},
        "status": {"phase": phase, "podIP": ip},
    }


async def eventually(probe: Callable[[], Any], deadline_s: float = 10.0) -> Any:
    """Poll until `probe` (sync or async) returns a truthy value, failing after `deadline_s` seconds."""
    deadline = time.monotonic() + deadline_s
    while True:
        result = probe()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError("condition not met before the deadline")
        await asyncio.sleep(0.05)


class TrickleServer(_HttpServer):
    """Serves `page` at /metrics in writes of `chunk` bytes, each drained before the next, as a page
    arrives over a real network in many reads.

    `length` announces a Content-Length (None: chunked encoding); `cut_after` closes the connection after
    that many bytes, a page cut short.
    """

    def __init__(self, page: bytes, chunk: int, *, length: int | None = None, cut_after: int | None = None):
        super().__init__()
        self.page = page
        self.chunk = chunk
        self.length = length
        self.cut_after = cut_after
        self.app.router.add_get("/metrics", self._metrics)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/metrics"

    async def _metrics(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/plain; version=0.0.4"})
        if self.length is not None:
            resp.content_length = self.length
        await resp.prepare(request)
        end = len(self.page) if self.cut_after is None else self.cut_after
        for start in range(0, end, self.chunk):
            await resp.write(self.page[start : min(end, start + self.chunk)])
        if self.cut_after is not None:
            assert request.transport is not None
            request.transport.close()
            return resp
        await resp.write_eof()
        return resp
