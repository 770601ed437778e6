"""The protection tests' overload of the real engine (tests/engine/test_protection_engine.py has the why of
its figures): distinct prompts, long answers, each request retried after its 429's hint until served. The
single gateway and the fleet of two (tests/engine/test_fleet_engine.py) send the same one."""

from __future__ import annotations

import concurrent.futures
import random
import time
from collections.abc import Sequence
from typing import Any

from tests.engine.stacks import engine_config
from tests.support.engine import MODEL, Engine
from tests.support.stack import http, metric

REQUESTS = 14
"""Twice what the cache holds at full length (seven), so the overload preempts even when the host delays a
few of the requests: ten, three past what fits, ran without a preemption in one of four runs of the tier."""
PROMPT_WORDS = 1000
OUTPUT_TOKENS = 1200
WORDS = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "river",
    "stone",
    "cloud",
    "maple",
    "orbit",
    "falcon",
    "ember",
    "prism",
]


def prompt(seed: int) -> str:
    """Distinct prompts: identical ones would share cached prefix blocks and overflow nothing."""
    rnd = random.Random(seed)
    return " ".join(rnd.choice(WORDS) for _ in range(PROMPT_WORDS))


def body(seed: int) -> dict[str, Any]:
    # Streamed, as chat clients do: the lean profile learns the pool's decode pace from streams' end
    # reports, and the KV refusals' retry-after is forecast at that pace (1 s until one is known).
    return {"model": MODEL, "prompt": prompt(seed), "max_tokens": OUTPUT_TOKENS, "stream": True}


def call(url: str, seed: int, deadline: float) -> tuple[int, list[float]]:
    """One request, retried after each 429's `retry-after-ms` until served: (status, the hints given)."""
    hints: list[float] = []
    while True:
        # A preempted stream sends nothing until the engine schedules it again: on a slow host straight to
        # the engine that gap passed the default 60 s read timeout (twice in one session, the test failing
        # on the timeout, not on its assertion).
        reply = http("POST", f"{url}/v1/completions", body(seed), timeout_s=300)
        if reply.status != 429 or time.monotonic() > deadline:
            return reply.status, hints
        hints.append(float(reply.headers.get("retry-after-ms", "1000")) / 1000)
        time.sleep(min(hints[-1], 10.0))


def overload(urls: str | Sequence[str], base_seed: int) -> list[tuple[int, list[float]]]:
    """The `REQUESTS` at once, request i through `urls[i % len(urls)]` (one URL: all through it)."""
    targets = [urls] if isinstance(urls, str) else list(urls)
    deadline = time.monotonic() + 300
    with concurrent.futures.ThreadPoolExecutor(REQUESTS) as pool:
        futures = [
            pool.submit(call, targets[i % len(targets)], base_seed + i, deadline) for i in range(REQUESTS)
        ]
        return [f.result() for f in futures]


def preemptions(engine: Engine) -> float:
    return metric(f"{engine.url}/metrics", "vllm:num_preemptions_total")


def protected_config() -> dict[str, Any]:
    """The tier's config with the protection as shipped: bound admission and the KV budget at 0.9."""
    config = engine_config()
    config["admission"]["bound_admission"] = True
    config["kv_budget"] = {"enabled": True, "target_utilization": 0.9}
    return config
