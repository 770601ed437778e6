"""How the local stack starts its processes: it forks its children (a `preexec_fn` ties each to its
parent's life) only where gRPC's fork handlers cannot run in them (a CI run lost an Envoy to SIGABRT at
start, gRPC's child handler running in a child forked while the test process's gRPC threads were busy), and
it listens on ports outside the ephemeral range."""

from __future__ import annotations

import os
import sys

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
        monkeypatch.delitem(sys.modules, "grpc", raising=False)
    else:
        import grpc  # noqa: F401
    if setting is None:
        monkeypatch.delenv("GRPC_ENABLE_FORK_SUPPORT", raising=False)
    else:
        monkeypatch.setenv("GRPC_ENABLE_FORK_SUPPORT", setting)
    assert processes._grpc_fork_handlers_off() is forks


def test_free_ports_sit_below_the_ephemeral_range_and_never_repeat() -> None:
    """Outgoing connections take their local ports from the ephemeral range: a listening port picked there
    can be taken before its process binds it (a clean-clone run's Envoy failed so)."""
    floor = processes._ephemeral_floor()
    ports = [processes.free_port() for _ in range(50)]
    assert len(set(ports)) == 50
    if floor - processes.LISTEN_PORTS_FLOOR >= 1000:
        assert all(processes.LISTEN_PORTS_FLOOR <= p < floor for p in ports)
