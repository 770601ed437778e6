"""The real-engine tier's fixture: one engine for the package (tests/support/engine.py has the how), and the
logs of the processes a failed test ran on, attached to its report: a failure in CI leaves nothing else."""

from __future__ import annotations

import re
from collections.abc import Generator, Iterator

import pluggy
import pytest

from extproc.envoyconf.profiles import PROFILES
from tests.engine.stacks import engine_config, start_gateway
from tests.support.engine import Engine, running_engine
from tests.support.stack import Stack

LOG_TAIL_LINES = 60
"""How much of each process's log a failed test's report carries: Envoy's access log line names the phase that
timed out (`%RESPONSE_CODE_DETAILS%`), the sidecar's log what it was doing."""


@pytest.fixture(scope="package")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    """The package's one engine, stopped when the tier is done (it would otherwise hold 2 GiB and a core
    through the rest of the suite)."""
    with running_engine(tmp_path_factory.mktemp("engine")) as handle:
        yield handle


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
            envoy = value.stack.processes.get("envoy")
            if envoy is not None:
                report.sections.append((f"{name}: envoy's failed answers", _failed_answers(envoy.log())))
        elif isinstance(value, Engine):
            report.sections.append(("engine log (tail)", _tail(value.log())))


def _tail(text: str) -> str:
    return "\n".join(text.splitlines()[-LOG_TAIL_LINES:])


FAILED_ANSWER = re.compile(r'^\[[^]]+\] "[A-Z]+ [^"]*" [45]\d\d ')
"""An access-log line (the shipped format, `envoyconf`) of an answer Envoy gave with a 4xx or 5xx status: a
flood's one 503 scrolls out of the tail, and its response flags say whose it was (a CI run met one)."""


def _failed_answers(text: str) -> str:
    return "\n".join([line for line in text.splitlines() if FAILED_ANSWER.match(line)][-LOG_TAIL_LINES:])
