"""Marks every test under tests/e2e as `e2e`, so `pytest -m "not e2e"` runs without starting processes, and
has pytest rewrite the asserts of the support modules that hold shared test cases."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# gRPC's fork handlers (on by default in its core) run in a child forked while this process's gRPC threads
# are busy, and can abort it before it execs (a CI run's Envoy died so, SIGABRT, with gRPC's "epoll_wait
# error" in its log): the tests start their processes with a preexec_fn (devstack/processes.py), which
# forks. Nothing here forks to keep using gRPC in a child, so the handlers go, before gRPC is imported.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

# The limiter's behaviour cases assert in a support module: rewritten like a test module's, a failing case
# shows its values.
pytest.register_assert_rewrite("tests.support.limiter_cases", "tests.support.store_harness")

E2E_DIR = Path(__file__).parent / "e2e"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if E2E_DIR in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.e2e)
