"""Programmatic entry: start the simulator on a host/port inside a running event loop, and stop it.

Tests and benchmarks either run it in-process (`async with running_server(cfg) as sim: ...`) or as a
subprocess (`python -m extproc.sim`); both go through `SimServer`, so they behave the same.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator

from aiohttp import web

from extproc.sim.api import ENGINE_KEY, build_app
from extproc.sim.config import SimConfig
from extproc.sim.engine import Engine

log = logging.getLogger(__name__)


class SimServer:
    """An aiohttp site serving one simulated engine; port 0 picks a free port (see `.port`)."""

    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.app = build_app(config)
        self._runner: web.AppRunner | None = None
        self.port: int = config.port

    @property
    def engine(self) -> Engine:
        return self.app[ENGINE_KEY]

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.port}"

    async def start(self) -> None:
        # handler_cancellation: a client disconnect cancels its handler, which aborts the sequence and
        # frees its KV blocks, as vLLM does on http.disconnect.
        self._runner = web.AppRunner(
            self.app, handler_cancellation=True, access_log=None, shutdown_timeout=1.0
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.host, self.config.port)
        await site.start()
        server = getattr(site, "_server", None)
        sockets = getattr(server, "sockets", None) or []
        if sockets:
            self.port = sockets[0].getsockname()[1]
        log.info("simulator listening on %s", self.url)

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


@contextlib.asynccontextmanager
async def running_server(config: SimConfig) -> AsyncIterator[SimServer]:
    """Start a simulator for the duration of an `async with` block."""
    server = SimServer(config)
    await server.start()
    try:
        yield server
    finally:
        await server.stop()
