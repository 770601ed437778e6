"""A tenant that trains its own completion forecast down, then bursts, on the real engine (issue 40, the
poison-then-burst case; tests/e2e/test_poison_e2e.py is the same on the simulator).

Forty chats with `max_tokens: 1500` that the engine ends after one token (the request biases the end-of-turn
token, which the tier's model never picks unbidden: tests/engine/build_model.py) teach the tenant's learned
share its floor (0.1): each later request of the tenant is expected to use 150 of its 1,500 tokens. Then
twelve streams with `max_tokens: 1500` that run to their end arrive at once: about 144 blocks of the 127 the
engine has. Booked at the learned share, all twelve would be admitted and their answers would outgrow the
cache. The credit a tenant's requests may take below their allowances is bounded (`kv_budget.
unconfirmed_share`, extproc/core/kv/credit.py): the burst must preempt nothing, and what is refused gets 429.
Checked that it can fail: with `unconfirmed_share: 1.0` the burst was all admitted and preempted.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.engine.overload import preemptions, protected_config
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
from tests.support.stack import Reply, Stack, http

pytestmark = [pytest.mark.engine, pytest.mark.timeout(ENGINE_TEST_TIMEOUT_S)]

ALLOWANCE = 1_500
BURST = 12
TRAINING = 40
EOT_ID = 100263
"""`<|eot_id|>` in the tier's tokenizer (tests/engine/build_model.py: cl100k's ranks, then Llama-3's
specials)."""
TENANT = {"x-tenant": "mallory"}


@pytest.fixture(scope="module")
def gateway(engine: Engine) -> Iterator[Stack]:
    stack = start_gateway(engine, protected_config(), "lean", with_exporter=True)
    try:
        yield Stack(stack)
    finally:
        stack.stop()


def body(stream: bool, stop_at_once: bool) -> dict[str, Any]:
    out: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": ALLOWANCE,
        "stream": stream,
        "messages": [{"role": "user", "content": "Tell me everything."}],
    }
    if stop_at_once:
        out["logit_bias"] = {str(EOT_ID): 100}
    return out


def ask(gateway: Stack, stream: bool, stop_at_once: bool) -> Reply:
    url = f"{gateway.url}/v1/chat/completions"
    return http("POST", url, body(stream, stop_at_once), TENANT, timeout_s=300)


def train(gateway: Stack) -> None:
    """One answer of one token at a time, as a client that honours `retry-after` sends them."""
    for _ in range(TRAINING):
        for _attempt in range(30):
            reply = ask(gateway, stream=False, stop_at_once=True)
            if reply.status != 429:
                break
            time.sleep(min(2.0, float(reply.headers.get("retry-after", "1"))))
        assert reply.status == 200, reply.status


def test_a_trained_down_tenant_cannot_burst_the_engine_into_preemption(
    engine: Engine, gateway: Stack
) -> None:
    shape = cache_shape(engine.url)
    demand = blocks_at_end([tokenize(engine.url, body(True, False))] * BURST, ALLOWANCE, shape)
    assert demand > shape.usable_blocks, f"the burst needs {demand} blocks of {shape.usable_blocks}"
    deadline = time.monotonic() + 60
    while gateway.sidecar("extproc_kv_capacity_tokens") != CACHE_TOKENS:
        assert time.monotonic() < deadline, "the KV feed never reported the engine's capacity"
        time.sleep(0.2)
    train(gateway)
    wait_idle(gateway)
    before = preemptions(engine)
    with concurrent.futures.ThreadPoolExecutor(BURST) as pool:
        replies = list(pool.map(lambda _: ask(gateway, stream=True, stop_at_once=False), range(BURST)))
    statuses = [reply.status for reply in replies]
    print(
        f"poison then burst: {statuses.count(200)} of {BURST} admitted, "
        f"{demand} blocks asked of {shape.usable_blocks}"
    )
    assert set(statuses) <= {200, 429}, statuses
    assert statuses.count(200) >= 1, statuses
    assert preemptions(engine) - before == 0, statuses
    wait_idle(gateway)
