"""What `make run` shows: its banner's own load loop, pasted as printed, meets the KV budget (the local
simulator's 16,384-token cache, config/local.yaml's slots above it). The shipped `interactive` class waits
up to 25 s for the KV, so two waves of seven are answered, and what the cache cannot take by then gets 429s
that name the reason and carry a forecast `retry-after`. The stack is built as `foreground_stack` builds it,
on free ports."""

from __future__ import annotations

import re
import subprocess
import time
from collections.abc import Iterator

import pytest
import yaml

from devstack.run import BANNER, LOCAL_SIM_ARGS
from devstack.stack import LOCAL_CONFIG
from tests.support.stack import Stack, start_stack

pytestmark = pytest.mark.e2e
MODEL = "llama-3-8b"
CACHE_TOKENS = 1024 * 16


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    config = yaml.safe_load(LOCAL_CONFIG.read_text())
    local = start_stack(config, LOCAL_SIM_ARGS, profile="lean", with_exporter=True, envoy_patch=None)
    try:
        yield Stack(local)
    finally:
        local.stop()


def banner_loop(stack: Stack) -> str:
    """The banner's `for ... done; wait` loop, on this stack's ports, as a user pastes it."""
    p = stack.stack.ports
    text = BANNER.format(
        envoy=p.envoy,
        envoy_admin=p.envoy_admin,
        grpc=p.grpc,
        admin=p.admin,
        upstream=stack.stack.upstream_url,
        upstream_name="simulator",
        model=MODEL,
        exporter=p.exporter,
        exporter_metrics=p.exporter_metrics,
        workdir="run",
        config="config/local.yaml",
        profile="lean",
        other="inline",
    )
    found = re.search(r"^  for i in .*?; wait$", text, re.MULTILINE | re.DOTALL)
    assert found, text
    return found.group(0)


def test_the_banner_loop_meets_the_kv_budget(stack: Stack) -> None:
    deadline = time.monotonic() + 30
    while stack.sidecar("extproc_kv_capacity_tokens", pool=MODEL) != CACHE_TOKENS:
        assert time.monotonic() < deadline, "the feed never reported the simulator's cache"
        time.sleep(0.2)
    out = subprocess.run(["bash", "-c", banner_loop(stack)], capture_output=True, text=True, timeout=120)
    lines = out.stdout.split("\n")
    refused = [line.split() for line in lines if line.startswith("429")]
    # Seven fit the cache at once and the next seven waited for it (before the queue: the seven alone).
    assert len([line for line in lines if line.startswith("200")]) >= 10, out.stdout
    assert refused and all(words[1] == "kv_budget" for words in refused), out.stdout
    assert all(int(words[3]) >= 1 for words in refused), out.stdout  # a forecast, never "now"
