"""The kvfeed component suites' shared fixture: a fake vLLM serving a recorded metrics page."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from .fakes import FakeInferenceServer


@pytest.fixture
async def vllm() -> AsyncIterator[FakeInferenceServer]:
    """vLLM 0.33.0's recorded page with two data-parallel engines (tests/data/metrics/)."""
    server = FakeInferenceServer.from_file("vllm_0.33.0_dp2.txt")
    await server.start()
    yield server
    await server.stop()
