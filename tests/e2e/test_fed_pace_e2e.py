"""An end-report channel that never worked (lean profile): leases are charged what the engine counted from
the KV feed, not at the assumed rate.

Envoy's access log to the sidecar points at a port nobody listens on from the start, so no stream ever
completes at the sidecar and no decode rate is learned. The simulator (20 tokens/s per sequence) is scraped
by a real exporter whose samples carry the engine's generation counter and decode pace; each lease expires
with nothing of its answer seen and is charged its share of the counter's growth over its time
(`core.engine_tally`): within 5 % of the tokens generated (320 of 320 in four runs), where the fed pace
over each request's time charged 1.03-1.08x and the assumed 100 tokens/s 5x.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from devstack.processes import free_port
from devstack.stack import LocalStack
from tests.support.stack import (
    build_stack,
    dead_end_reports,
    fixed_step_sim,
    metric,
    stream_chat,
    wait_fed,
)

MODEL = "llama-3-8b"
STEP_MS = 50  # 20 tokens/s per sequence, about the pace the fault suite measured on its engine
STREAMS = 4
ANSWER = 80  # 4 s per answer: the exporter's one-second windows see the batch at full size
RESERVED = 1000  # max_tokens: the cap of each charge, far above the answer so the rate decides the charge
CONFIG: dict[str, Any] = {
    # The model is configured, so it is its own pool, the one the feed reports (`models."*"` pools every
    # unconfigured name under "*", which no engine reports).
    "models": {"*": {"context_window": 4096, "default_max_tokens": 256}, MODEL: {"context_window": 4096}},
    "limits": {"global": {"tokens_per_minute": 10_000_000, "max_concurrency": 8}},
    "admission": {"end_report_wait_seconds": 5, "assumed_decode_tokens_per_second": 100},
}


@pytest.fixture
def no_reports() -> Iterator[LocalStack]:
    stack = build_stack(
        config=CONFIG,
        sim_args=fixed_step_sim(MODEL, STEP_MS),
        envoy_patch=dead_end_reports(free_port()),
        profile="lean",
        with_exporter=True,
    )
    try:
        stack.start()
        yield stack
    finally:
        stack.stop()


def test_leases_without_any_end_report_are_charged_the_engines_count(no_reports: LocalStack) -> None:
    stack = no_reports
    sidecar = f"{stack.admin_url}/metrics"
    generated = f"{stack.upstream_url}/metrics"
    wait_fed(stack)
    before_generated = metric(generated, "vllm:generation_tokens_total")
    before_charged = metric(sidecar, "extproc_tokens_settled_total", kind="completion")
    usages: list[int] = []
    threads = [
        threading.Thread(target=stream_chat, args=(stack.envoy_url, MODEL, RESERVED, ANSWER, usages))
        for _ in range(STREAMS)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert usages == [ANSWER] * STREAMS
    deadline = time.monotonic() + 20
    while metric(sidecar, "extproc_settlements_total", outcome="expired") < STREAMS:
        assert time.monotonic() < deadline, "the leases did not expire"
        time.sleep(0.1)
    truth = metric(generated, "vllm:generation_tokens_total") - before_generated
    charged = metric(sidecar, "extproc_tokens_settled_total", kind="completion") - before_charged
    pace = metric(sidecar, "extproc_feed_decode_tokens_per_second", pool=MODEL)
    print(f"charged {charged} for {truth} generated at a fed pace of {pace:.1f} tokens/s")
    assert metric(sidecar, "extproc_end_reports_total", result="matched") == 0  # nothing was learned
    counted = metric(sidecar, "extproc_unfinished_answers_total", model=MODEL, basis="engine_count")
    assert counted == STREAMS, counted
    assert truth * 0.95 <= charged <= truth * 1.05, (charged, truth, pace)
