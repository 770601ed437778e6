"""Fixtures: in-process simulators on free ports and an HTTP session (helpers: tests/support/sim.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import aiohttp
import pytest

from extproc.sim.config import SimConfig
from extproc.sim.server import SimServer
from tests.support.sim import SimFactory


@pytest.fixture
async def start_sim() -> AsyncIterator[SimFactory]:
    """Start simulators with SimConfig overrides (port 0, fast clock by default); all stopped at teardown."""
    servers: list[SimServer] = []

    async def factory(**overrides: Any) -> SimServer:
        cfg = replace(SimConfig(port=0, time_scale=200.0, seed=1), **overrides)
        server = SimServer(cfg)
        await server.start()
        servers.append(server)
        return server

    yield factory
    for s in servers:
        await s.stop()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        yield session
