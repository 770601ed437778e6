"""`make run`'s messages: a taken port is named with its role before anything starts, and a process of the
stack that dies makes `make run` fail, naming its log."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from devstack.processes import Process
from devstack.run import supervise, taken_ports
from tests.support.stack import build_stack


def test_a_taken_port_is_named_with_its_role() -> None:
    stack = build_stack()
    assert taken_ports(stack) == []
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", stack.ports.envoy))
        holder.listen()
        assert taken_ports(stack) == [f"127.0.0.1:{stack.ports.envoy} (Envoy listener)"]


def test_a_process_that_dies_fails_the_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    stack = build_stack(workdir=tmp_path)
    dead = Process.start("sidecar", [sys.executable, "-c", "raise SystemExit(3)"], tmp_path)
    dead.popen.wait(timeout=30)
    stack.processes["sidecar"] = dead
    assert supervise(stack, poll_s=0.01) == 1
    err = capsys.readouterr().err
    assert "sidecar exited (3)" in err and str(dead.log_path) in err
    assert stack.processes == {}


def test_stopped_by_a_signal_the_run_succeeds(tmp_path: Path) -> None:
    stack = build_stack(workdir=tmp_path)
    script = "import os, signal, time; time.sleep(0.2); os.kill(os.getppid(), signal.SIGTERM); time.sleep(30)"
    helper = subprocess.Popen([sys.executable, "-c", script])
    try:
        assert supervise(stack, poll_s=0.01) == 0
    finally:
        helper.kill()
        helper.wait()
