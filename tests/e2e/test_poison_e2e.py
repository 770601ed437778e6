"""A tenant that trains its own completion forecast down, then bursts: through the real Envoy, sidecar and
simulator, on `make run`'s geometry (a 16,384-token cache, the KV budget at 0.9).

Forty requests with `max_tokens: 4000` that stop after one token teach the tenant's learned share its floor
(0.1): each later request of the tenant is expected to use 400 of its 4,000 tokens. Then twelve streams with
`max_tokens: 4000` that run to their end arrive at once. Booked 420 tokens each, all twelve were admitted and
their answers outgrew the cache (13 preemptions, KV peak 1.00). The credit a tenant's requests may take below
their allowances is bounded (`extproc/core/kv/credit.py`): the burst must preempt nothing.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.stack import Reply, Stack, fixed_step_sim, http, start_stack

pytestmark = pytest.mark.e2e

MODEL = "llama-3-8b"
ALLOWANCE = 4_000
CONFIG: dict[str, Any] = {
    "models": {"*": {"context_window": 8192, "default_max_tokens": 1024}},
    "limits": {"models": {MODEL: {"max_concurrency": 32, "tokens_per_minute": 10_000_000}}},
    "kv_budget": {"enabled": True, "target_utilization": 0.9},
}
# make run's cache: 1,024 blocks of 16 tokens. A decode step of 2 ms: an answer of 4,000 tokens takes 8 s.
SIM_ARGS = fixed_step_sim(MODEL, 2, "--num-gpu-blocks", "1024", "--max-model-len", "8192")
TENANT = {"x-tenant-id": "mallory"}


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    local = start_stack(config=CONFIG, sim_args=SIM_ARGS, with_exporter=True, profile="lean")
    try:
        yield Stack(local)
    finally:
        local.stop()


def ask(stack: Stack, output: int, stream: bool) -> Reply:
    body = {
        "model": MODEL,
        "max_tokens": ALLOWANCE,
        "stream": stream,
        "messages": [{"role": "user", "content": "Tell me everything."}],
    }
    headers = {**TENANT, "x-sim-output-tokens": str(output)}
    return http("POST", f"{stack.url}/v1/chat/completions", body, headers, timeout_s=60)


def train(stack: Stack) -> None:
    """One answer of one token at a time, as a client that honours `retry-after` sends them: untrained, each
    is booked 4,020 tokens, and in the lean profile a lease ends with Envoy's end report, so the next may
    find the last three still booked and wait its turn."""
    for _ in range(40):
        for _attempt in range(20):
            reply = ask(stack, 1, stream=False)
            if reply.status != 429:
                break
            time.sleep(min(2.0, float(reply.headers.get("retry-after", "1"))))
        assert reply.status == 200, reply.status


def test_a_trained_down_tenant_cannot_burst_the_cache_into_preemption(stack: Stack) -> None:
    train(stack)
    preempted = stack.upstream("vllm:num_preemptions_total")
    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        statuses = list(pool.map(lambda _: ask(stack, ALLOWANCE, stream=True).status, range(12)))
    admitted = statuses.count(200)
    assert set(statuses) <= {200, 429}, statuses
    assert stack.upstream("vllm:num_preemptions_total") == preempted, statuses
    # As many as fit whole: the untrained burst admits 3 (each 4,020 of the 14,745 budget); the first of the
    # trained one takes the tenant's credit left, so one more.
    assert 3 <= admitted <= 4, statuses
