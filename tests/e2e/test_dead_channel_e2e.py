"""Envoy's access log dead from the start, ext_proc fine (lean profile; issue 40, item 5): the run the issue
measured, 20 streamed answers through 4 slots on `make run`'s own config, no end report ever coming.

Every lease expires and is charged its share of what the engine generated over its life, from the feed's
generation counter (`extproc_unfinished_answers_total{basis="engine_count"}`), not the decode-rate estimate:
with no stream seen to its end nothing is learned and the assumed 100 tokens/s would charge 5x the
simulator's 20 (the issue measured 5.14x). The channel's death is reported as such: the channel down,
lost because it never connected, once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from devstack.processes import free_port
from devstack.stack import LocalStack
from extproc.envoyconf.profiles import REPO
from tests.support.stack import (
    build_stack,
    dead_end_reports,
    fixed_step_sim,
    metric,
    stream_chat,
    wait_fed,
)

pytestmark = pytest.mark.e2e

MODEL = "llama-3-8b"
STEP_MS = 50  # 20 tokens/s per sequence
ANSWER = 80
SLOTS = 4
REQUESTS = 20


def make_run_config() -> dict[str, Any]:
    """config/local.yaml (`make run`) with 4 slots on the model and the assumed rate written out."""
    config: dict[str, Any] = yaml.safe_load((REPO / "config" / "local.yaml").read_text())
    config.pop("server")  # the stack's own ports
    config["limits"]["models"][MODEL]["max_concurrency"] = SLOTS
    config.setdefault("admission", {})["assumed_decode_tokens_per_second"] = 100
    return config


@pytest.fixture
def dead_channel() -> Iterator[LocalStack]:
    stack = build_stack(
        config=make_run_config(),
        sim_args=fixed_step_sim(MODEL, STEP_MS),
        envoy_patch=dead_end_reports(free_port()),  # nothing listens there
        profile="lean",
        with_exporter=True,
    )
    try:
        stack.start()
        yield stack
    finally:
        stack.stop()


def test_a_dead_access_log_charges_what_the_engine_generated_and_says_the_channel_is_down(
    dead_channel: LocalStack,
) -> None:
    stack = dead_channel
    sidecar = f"{stack.admin_url}/metrics"
    engine = f"{stack.upstream_url}/metrics"
    wait_fed(stack)
    before = metric(engine, "vllm:generation_tokens_total")
    usages: list[int] = []
    threads = [
        threading.Thread(target=stream_chat, args=(stack.envoy_url, MODEL, 1000, ANSWER, usages))
        for _ in range(REQUESTS)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert usages == [ANSWER] * REQUESTS  # the interactive class queued what the 4 slots could not take
    deadline = time.monotonic() + 30
    while metric(sidecar, "extproc_settlements_total", outcome="expired") < REQUESTS:
        assert time.monotonic() < deadline, "the leases did not expire"
        time.sleep(0.1)
    truth = metric(engine, "vllm:generation_tokens_total") - before
    charged = metric(sidecar, "extproc_tokens_settled_total", kind="completion")
    counted = metric(sidecar, "extproc_unfinished_answers_total", basis="engine_count")
    print(f"charged {charged} for {truth} generated: {charged / truth:.3f}x; {counted} counted")
    assert counted == REQUESTS
    assert truth * 0.9 <= charged <= truth * 1.1, (charged, truth)
    assert metric(sidecar, "extproc_end_report_channel_up") == 0
    assert metric(sidecar, "extproc_end_report_channel_losses_total", cause="never_connected") == 1
    assert metric(sidecar, "extproc_end_reports_total", result="matched") == 0
