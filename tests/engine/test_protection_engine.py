"""Protection on the real engine: an overload that overflows its 16,384-token cache preempts requests when
sent straight to vLLM, and preempts none through the gateway's KV budget.

Fourteen requests of about 1,100 prompt and 1,200 output tokens need about 250 blocks of the 127 usable:
vLLM admits them all (their prompts fit), then preempts as their answers grow until seven run (measured on
this engine: 10 requests, 3 preemptions; 12, 5; 14, 7) (`vllm:num_preemptions_total`,
v1/core/sched/scheduler.py). Through the gateway the KV budget (target 0.9) admits what fits and refuses
the rest with 429 and a retry hint; the client here waits the hint and tries again until it is served.

That the overload overflows the cache is asserted from the engine's own numbers (its prompts as it
tokenizes them, its block size and count from `vllm:cache_config_info`); the straight run's preemptions are
reported, not required: how many the engine alone makes depends on the host's pace as well.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from tests.engine.overload import (
    OUTPUT_TOKENS,
    REQUESTS,
    body,
    overload,
    preemptions,
    prompt,
    protected_config,
)
from tests.engine.stacks import start_gateway, wait_idle
from tests.support.engine import (
    CACHE_TOKENS,
    ENGINE_TEST_TIMEOUT_S,
    MODEL,
    Engine,
    blocks_at_end,
    cache_shape,
    tokenize,
)
from tests.support.stack import Stack, http

pytestmark = [pytest.mark.engine, pytest.mark.timeout(ENGINE_TEST_TIMEOUT_S)]


@pytest.fixture(scope="module")
def gateway(engine: Engine) -> Iterator[Stack]:
    stack = start_gateway(engine, protected_config(), "lean", with_exporter=True)
    try:
        yield Stack(stack)
    finally:
        stack.stop()


def test_direct_overload_overflows_the_cache(engine: Engine) -> None:
    """The overload needs more blocks than the engine has (by its own numbers), and the engine alone serves
    it all, preempting as the answers grow (reported)."""
    shape = cache_shape(engine.url)
    demand = blocks_at_end(
        [tokenize(engine.url, body(1000 + i)) for i in range(REQUESTS)], OUTPUT_TOKENS, shape
    )
    assert demand > shape.usable_blocks, f"the overload needs {demand} blocks of {shape.usable_blocks}"
    before = preemptions(engine)
    started = time.monotonic()
    results = overload(engine.url, 1000)
    took = time.monotonic() - started
    print(
        f"straight: {demand} blocks needed of {shape.usable_blocks}, "
        f"{preemptions(engine) - before:.0f} preemptions in {took:.1f}s"
    )
    assert [status for status, _ in results] == [200] * REQUESTS


def test_gateway_overload_preempts_nothing(engine: Engine, gateway: Stack) -> None:
    deadline = time.monotonic() + 60
    while gateway.sidecar("extproc_kv_capacity_tokens") != CACHE_TOKENS:
        assert time.monotonic() < deadline, "the KV feed never reported the engine's capacity"
        time.sleep(0.2)
    # A pool in service has a decode pace learned from finished streams; the KV refusals' retry-after is
    # forecast at it (a fixed second until one is known). One short stream teaches it here.
    warm = {"model": MODEL, "prompt": prompt(1), "max_tokens": 64, "stream": True}
    assert http("POST", f"{gateway.url}/v1/completions", warm).status == 200
    wait_idle(gateway)
    before = preemptions(engine)
    results = overload(gateway.url, 2000)
    assert [status for status, _ in results] == [200] * REQUESTS
    hints = [hint for _, given in results for hint in given]
    assert hints, "the overload never reached the KV budget"
    assert preemptions(engine) - before == 0
    # The refusals' retry-after is the forecast of when booked KV frees, never under a second: a pace
    # learned from one short stream is faster than the overloaded batch's, and a forecast of "now" for a
    # refused request once sent clients back within 50 ms. Admitted answers run for seconds, so most runs
    # also see hints well past the second (tests/unit/core/kv/test_retry_after.py pins the arithmetic).
    assert min(hints) >= 1.0, hints
    wait_idle(gateway)
