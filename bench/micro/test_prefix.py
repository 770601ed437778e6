"""Microbenchmarks of the prefix index before a crowd (issue 40): the KV budget's decision and a change of
replicas with 1,000 leases in flight, each holding a prompt of 2,000 chunks whose first 1,600 all of them
share (a long common prefix: a system prompt, an agent's tools, a resent conversation) and 400 of its own.

Run with `python -m pytest bench/micro -k prefix --benchmark-only`. `counted` is the index of
extproc/core/kv/prefix.py; `list` the one it replaced (a list of holders per chunk, scanned; a candidate
inserted and removed; every lease re-added on a change of replicas: tests/support/prefix_reference.py), in the
same run. Lifetime booking (no clock), so the decision's cost is the index's, not the forecast's.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from extproc.core.kv.budget import KvBudget
from extproc.core.kv.prefix import PromptChunks
from tests.support.prefix_reference import ListBudget

LEASES, CHUNKS, SHARED = 1_000, 2_000, 1_600
PROMPT = 100_000  # tokens of each prompt (50 per chunk)
KINDS = {"counted": KvBudget, "list": ListBudget}


def _chunks(own: int) -> PromptChunks:
    """The shared leading run, then `CHUNKS - SHARED` chunks no other prompt holds."""
    tail = range(10**9 + own * CHUNKS, 10**9 + own * CHUNKS + CHUNKS - SHARED)
    return PromptChunks((*range(SHARED), *tail), chunk_chars=200, text_chars=200 * CHUNKS)


@pytest.fixture(scope="module", params=list(KINDS))
def crowd(request: pytest.FixtureRequest) -> KvBudget:
    kv: KvBudget = KINDS[request.param](10**12, target_utilization=1.0)
    for i in range(LEASES):
        kv.admit(f"lease-{i}", PROMPT, 500, chunks=_chunks(i))
    return kv


def test_prefix_would_fit(benchmark: Any, crowd: KvBudget) -> None:
    """One admission decision for a prompt sharing the crowd's prefix: the candidate credits the newest
    lease 1,600 chunks for the sum, then nothing has changed."""
    crowd.set_replicas(1)
    candidate = _chunks(LEASES)
    demand = crowd.demand_tokens
    fits, _ = benchmark(crowd.would_fit, PROMPT, 500, chunks=candidate)
    assert fits and crowd.demand_tokens == demand


def test_prefix_set_replicas(benchmark: Any, crowd: KvBudget) -> None:
    """A replica added, then removed, alternately: each call moves one holder per shared chunk between
    paying and credited (1,600 chunks, 1,000 holders each)."""
    crowd.set_replicas(1)
    counts = itertools.cycle((2, 1))
    shared = crowd.shared_prompt_tokens
    rounds = 1 if isinstance(crowd, ListBudget) else 50  # the list takes 10-30 s a call
    benchmark.pedantic(lambda: crowd.set_replicas(next(counts)), rounds=rounds, iterations=1, warmup_rounds=0)
    crowd.set_replicas(1)
    assert crowd.shared_prompt_tokens == shared
