"""The local stack forks its children (a `preexec_fn` ties each to its parent's life) only where gRPC's fork
handlers cannot run in them: a CI run lost an Envoy to SIGABRT at start, gRPC's child handler running in a
child forked while the test process's gRPC threads were busy."""

from __future__ import annotations

import os

import pytest

import devstack.processes as processes


def test_the_test_process_runs_with_grpc_fork_support_off() -> None:
    assert os.environ.get("GRPC_ENABLE_FORK_SUPPORT") == "false"  # tests/conftest.py, before gRPC loads


@pytest.mark.parametrize(
    ("loaded", "setting", "forks"),
    [
        (False, None, True),
        (True, "false", True),
        (True, "0", True),
        (True, None, False),
        (True, "1", False),
    ],
)
def test_a_preexec_fork_only_without_grpc_fork_handlers(
    monkeypatch: pytest.MonkeyPatch, loaded: bool, setting: str | None, forks: bool
) -> None:
    if not loaded:
        monkeypatch.delitem(processes.sys.modules, "grpc", raising=False)
    else:
        import grpc  # noqa: F401
    if setting is None:
        monkeypatch.delenv("GRPC_ENABLE_FORK_SUPPORT", raising=False)
    else:
        monkeypatch.setenv("GRPC_ENABLE_FORK_SUPPORT", setting)
    assert processes._grpc_fork_handlers_off() is forks
