"""The real-engine tier's fixture: one engine for the package (tests/support/engine.py has the how)."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator

import pytest

from devstack.processes import Process, free_port
from tests.support.engine import START_TIMEOUT_S, Engine, build_model, engine_argv, engine_python, wait_engine


@pytest.fixture(scope="package")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    """The package's one engine, stopped when the tier is done (it would otherwise hold 2 GiB and a core
    through the rest of the suite)."""
    python = engine_python()
    workdir = tmp_path_factory.mktemp("engine")
    model_dir = build_model(python, workdir / "model")
    port = free_port()
    # VLLM_ENABLE_COHERE_API: serve /cohere/v2/chat (vLLM 0.32.0 entrypoints/cohere/api_router.py:273-309)
    env = {
        "VLLM_HOST_IP": "127.0.0.1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "VLLM_ENABLE_COHERE_API": "1",
    }
    started = time.monotonic()
    process = Process.start("vllm", engine_argv(python, model_dir, port), workdir, env)
    handle = Engine(process, port, model_dir)
    try:
        wait_engine(handle, START_TIMEOUT_S)
        print(f"engine tier: vLLM ready in {time.monotonic() - started:.1f}s", file=sys.stderr)
        yield handle
    finally:
        process.stop(timeout_s=30)
