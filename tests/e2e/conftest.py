"""End-to-end fixtures: a real Envoy, the sidecar and the simulator as processes on free localhost ports."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from devstack.stack import LocalStack
from extproc.envoyconf.profiles import PROFILES
from tests.support.stack import Stack, start_stack


@pytest.fixture(scope="module")
def make_stack() -> Iterator[Any]:
    stacks: list[LocalStack] = []

    def make(config: dict[str, Any], sim_args: list[str], profile: str = "inline") -> Stack:
        stack = start_stack(config, sim_args, profile)
        stacks.append(stack)
        return Stack(stack)

    yield make
    for stack in stacks:
        stack.stop()


@pytest.fixture(scope="module", params=PROFILES)
def profile(request: pytest.FixtureRequest) -> str:
    """Both profiles (docs/architecture.md): a module whose `stack` uses this runs every test on each, one
    stack at a time (pytest finishes one parameter's tests before it sets up the next)."""
    value: str = request.param
    return value
