"""The README's "in front of your own vLLM" quickstart, run as written against the tier's vLLM: `make run
UPSTREAM=...` (only the engine's port differs from the README's 8000) puts Envoy, the sidecar and the
exporter in front of the engine on the documented addresses, with the feed and the KV budget on, and Ctrl-C
stops it."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import time
from collections.abc import Callable

import pytest

from extproc.envoyconf.profiles import REPO
from tests.support.engine import CACHE_TOKENS, ENGINE_TEST_TIMEOUT_S, MODEL, Engine
from tests.support.stack import http, metric

pytestmark = [pytest.mark.engine, pytest.mark.timeout(ENGINE_TEST_TIMEOUT_S)]

ENVOY = "http://127.0.0.1:10000"
SIDECAR_METRICS = "http://127.0.0.1:9464/metrics"


def readme_command() -> str:
    """The quickstart's command, from the README's fenced block."""
    found = re.findall(r"^make run UPSTREAM=\S+$", (REPO / "README.md").read_text(), re.MULTILINE)
    assert len(found) == 1, f"README.md: {len(found)} `make run UPSTREAM=` commands"
    return str(found[0])


def wait_until(check: Callable[[], bool], what: str, limit_s: float, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"make run exited with {proc.returncode} before {what}"
        try:
            if check():
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"no {what} after {limit_s:.0f}s")


def test_the_quickstart_runs_as_written_in_front_of_the_engine(engine: Engine) -> None:
    command = readme_command().replace("127.0.0.1:8000", f"127.0.0.1:{engine.port}")
    log = REPO / "run" / "quickstart-test.log"
    log.parent.mkdir(exist_ok=True)
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            ["bash", "-c", command], cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        # The banner prints once every process is ready (upstream, sidecar, then Envoy).
        wait_until(lambda: b"Local stack is up" in log.read_bytes(), "the banner", 120, proc)
        body = {"model": MODEL, "max_tokens": 16, "messages": [{"role": "user", "content": "Hello"}]}
        reply = http("POST", f"{ENVOY}/v1/chat/completions", body)
        assert reply.status == 200, reply.body[:500]
        assert "x-ratelimit-remaining-tokens" in reply.headers

        def fed() -> bool:
            return metric(SIDECAR_METRICS, "extproc_kv_capacity_tokens", pool=MODEL) == CACHE_TOKENS

        wait_until(fed, "KV feed with the engine's capacity", 60, proc)
        assert metric(SIDECAR_METRICS, "extproc_kv_forecasting", pool=MODEL) in (0.0, 1.0)
        fitted = (REPO / "run" / "upstream.yaml").read_text()
        assert MODEL in fitted and "kv_budget" in fitted
    finally:
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: the terminal sends it to make and the stack alike
        proc.wait(timeout=60)  # make reports the interrupt in its own exit status, whatever the stack did
    assert "stopping the local stack" in log.read_text(), log.read_text()[-3000:]
    deadline = time.monotonic() + 30
    for port in (10000, 9464, 50051, 50061):  # every process of the stack goes, and its port with it
        while answers(port):
            assert time.monotonic() < deadline, f"127.0.0.1:{port} still answers after Ctrl-C"
            time.sleep(0.2)


def answers(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0
