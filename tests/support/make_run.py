"""`make run`'s stack as the README starts it, for the e2e tests that check what it serves: config/local.yaml,
the lean profile, the simulator with make run's arguments (a 16,384-token cache), its KV-cache exporter."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import yaml

from devstack.run import LOCAL_SIM_ARGS
from devstack.stack import LOCAL_CONFIG
from tests.support.stack import Stack, start_stack

CACHE_TOKENS = 1024 * 16
"""The simulator's cache as make run starts it (1,024 blocks of 16 tokens)."""


@contextlib.contextmanager
def make_run_stack(change: Callable[[dict[str, Any]], None] | None = None) -> Iterator[Stack]:
    """The stack, `change` applied to its config first, once the feed reports the simulator's cache."""
    config = yaml.safe_load(LOCAL_CONFIG.read_text())
    if change is not None:
        change(config)
    local = start_stack(config, LOCAL_SIM_ARGS, profile="lean", with_exporter=True, envoy_patch=None)
    try:
        stack = Stack(local)
        deadline = time.monotonic() + 30
        while stack.sidecar("extproc_kv_capacity_tokens") != CACHE_TOKENS:
            assert time.monotonic() < deadline, "the feed never reported the simulator's cache"
            time.sleep(0.2)
        yield stack
    finally:
        local.stop()
