"""The real-engine tier's fixture: one engine for the package (tests/support/engine.py has the how), and the
logs of the processes a failed test ran on, attached to its report: a failure in CI leaves nothing else."""

from __future__ import annotations

import sys
import time
from collections.abc import Generator, Iterator

import pluggy
import pytest

from devstack.processes import Process, free_port
from extproc.envoyconf.profiles import PROFILES
from tests.engine.stacks import engine_config, start_gateway
from tests.support.engine import START_TIMEOUT_S, Engine, build_model, engine_argv, engine_python, wait_engine
from tests.support.stack import Stack

LOG_TAIL_LINES = 60
"""How much of each process's log a failed test's report carries: Envoy's access log line names the phase that
timed out (`%RESPONSE_CODE_DETAILS%`), the sidecar's log what it was doing."""


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


@pytest.fixture(scope="module", params=PROFILES)
def stack(request: pytest.FixtureRequest, engine: Engine) -> Iterator[Stack]:
    """A module's gateway in front of the engine, once per profile, with the tier's config."""
    gateway = start_gateway(engine, engine_config(), request.param)
    try:
        yield Stack(gateway)
    finally:
        gateway.stop()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pluggy.Result[pytest.TestReport], None]:
    """On a failed test, the tails of its stacks' logs (Envoy, sidecar, exporter) and the engine's."""
    outcome = yield
    report = outcome.get_result()
    if report.when != "call" or not report.failed:
        return
    funcargs = getattr(item, "funcargs", {})
    for name, value in funcargs.items():
        if isinstance(value, Stack):
            for proc_name, proc in value.stack.processes.items():
                report.sections.append((f"{name}: {proc_name} log (tail)", _tail(proc.log())))
        elif isinstance(value, Engine):
            report.sections.append(("engine log (tail)", _tail(value.log())))


def _tail(text: str) -> str:
    return "\n".join(text.splitlines()[-LOG_TAIL_LINES:])
