"""Shared prompt prefixes on the real engine: forty streamed chats that share one long system prompt overflow
vLLM's 16,384-token cache straight to it (its prefix cache holds the system prompt once, so all forty start
and their answers outgrow the cache), and through the gateway preempt nothing while the KV budget lets the
cache fill: it books the shared prompt once, as the engine holds it (extproc/core/prefix_index.py).

The workload is the one that showed the budget refusing while two thirds of the cache stood empty: a system
prompt of ~1,550 tokens (12 of the engine's 128-token blocks), ~30 tokens of each request's own, 300 output
tokens with `ignore_eos`, clients that honour `retry-after`. vLLM's own counters say what it shared
(`vllm:prefix_cache_hits_total` / `vllm:prefix_cache_queries_total`, v1/metrics/loggers.py) and how full
its cache got (`vllm:kv_cache_usage_perc`, sampled while the load runs).
"""

from __future__ import annotations

import concurrent.futures
import random
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from tests.engine.stacks import engine_config, start_gateway, wait_idle
from tests.support.engine import CACHE_TOKENS, ENGINE_TEST_TIMEOUT_S, MODEL, Engine
from tests.support.stack import Stack, http, metric

pytestmark = [pytest.mark.engine, pytest.mark.timeout(ENGINE_TEST_TIMEOUT_S)]

REQUESTS = 40
SYSTEM_WORDS = 1550
OWN_WORDS = 30
OUTPUT_TOKENS = 300
WORDS = ("alpha", "beta", "gamma", "delta", "river", "stone", "cloud", "maple", "orbit", "falcon", "ember")

KV_PEAK_FLOOR = 0.85
"""The cache the gateway lets the engine fill at the peak: the budget's target is 0.9 of it, less the one
chunk of margin per request the prefix credit keeps (issue target: >= 0.85; 0.32 when prompts were booked
whole)."""
THROUGHPUT_FLOOR = 0.8
"""The gateway's output tokens per second against the engine alone in the same run. The benchmark's target is
0.95 (bench/RESULTS.md, shared prefixes); this host's two cores, shared by the engine, Envoy, the sidecar and
the forty clients, make one run's ratio noisy, so the test holds the bar that a regression to booking whole
prompts (0.52) cannot pass."""


def words(seed: int, count: int) -> str:
    rnd = random.Random(seed)
    return " ".join(rnd.choice(WORDS) for _ in range(count))


SYSTEM = words(7, SYSTEM_WORDS)


def chat_body(index: int) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"question {index}: " + words(1000 + index, OWN_WORDS)},
        ],
        "max_tokens": OUTPUT_TOKENS,
        "ignore_eos": True,
        "stream": True,
    }


def call(url: str, index: int, deadline: float) -> tuple[int, int]:
    """One chat, retried after each 429's `retry-after-ms` until served: (status, refusals)."""
    refusals = 0
    while True:
        reply = http("POST", f"{url}/v1/chat/completions", chat_body(index))
        if reply.status != 429 or time.monotonic() > deadline:
            return reply.status, refusals
        refusals += 1
        time.sleep(min(float(reply.headers.get("retry-after-ms", "1000")) / 1000, 10.0))


@dataclass
class Run:
    statuses: list[int]
    refusals: int
    seconds: float
    generated: float
    preemptions: float
    kv_peak: float
    hit_rate: float

    @property
    def tokens_per_second(self) -> float:
        return self.generated / self.seconds

    def __str__(self) -> str:
        return (
            f"{self.statuses.count(200)}/{len(self.statuses)} in {self.seconds:.1f}s, "
            f"{self.tokens_per_second:.0f} output tok/s, {self.preemptions:.0f} preemptions, "
            f"KV peak {self.kv_peak:.2f}, prefix hits {self.hit_rate:.0%}, {self.refusals} refusals"
        )


class KvSampler:
    """The engine's KV usage, sampled every 0.2 s while a load runs: its peak."""

    def __init__(self, engine: Engine) -> None:
        self.url = f"{engine.url}/metrics"
        self.peak = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            try:
                self.peak = max(self.peak, metric(self.url, "vllm:kv_cache_usage_perc"))
            except OSError:
                continue

    def __enter__(self) -> KvSampler:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()


def counters(engine: Engine) -> dict[str, float]:
    url = f"{engine.url}/metrics"
    names = ("generation_tokens", "num_preemptions", "prefix_cache_hits", "prefix_cache_queries")
    return {name: metric(url, f"vllm:{name}_total") for name in names}


def load(engine: Engine, url: str, settle: Callable[[], None]) -> Run:
    """The forty chats at once against `url`; the engine's counters around them."""
    settle()
    before = counters(engine)
    deadline = time.monotonic() + 300
    started = time.monotonic()
    with KvSampler(engine) as kv, concurrent.futures.ThreadPoolExecutor(REQUESTS) as pool:
        results = list(pool.map(lambda i: call(url, i, deadline), range(REQUESTS)))
    seconds = time.monotonic() - started
    settle()
    after = counters(engine)
    delta = {name: after[name] - before[name] for name in after}
    return Run(
        statuses=[status for status, _ in results],
        refusals=sum(refused for _, refused in results),
        seconds=seconds,
        generated=delta["generation_tokens"],
        preemptions=delta["num_preemptions"],
        kv_peak=kv.peak,
        hit_rate=delta["prefix_cache_hits"] / max(1.0, delta["prefix_cache_queries"]),
    )


def prefix_config() -> dict[str, Any]:
    """The shipped protection (bound admission, forecast booking, prefix sharing) with slots out of the way:
    only the KV budget decides."""
    config = engine_config()
    config["admission"]["bound_admission"] = True
    config["limits"]["models"] = {MODEL: {"max_concurrency": 128}}
    config["kv_budget"] = {"enabled": True, "target_utilization": 0.9}
    return config


@pytest.fixture(scope="module")
def gateway(engine: Engine) -> Iterator[Stack]:
    stack = start_gateway(engine, prefix_config(), "lean", with_exporter=True)
    try:
        yield Stack(stack)
    finally:
        stack.stop()


def engine_idle(engine: Engine) -> Callable[[], None]:
    def settle() -> None:
        deadline = time.monotonic() + 60
        url = f"{engine.url}/metrics"
        while metric(url, "vllm:num_requests_running") + metric(url, "vllm:num_requests_waiting"):
            assert time.monotonic() < deadline, "the engine did not go idle"
            time.sleep(0.1)

    return settle


def test_shared_prefix_overload(engine: Engine, gateway: Stack) -> None:
    deadline = time.monotonic() + 60
    while gateway.sidecar("extproc_kv_capacity_tokens") != CACHE_TOKENS:
        assert time.monotonic() < deadline, "the KV feed never reported the engine's capacity"
        time.sleep(0.2)
    # A pool in service has a decode pace learned from finished streams (the forecast and the refusals'
    # retry-after use it); one short stream teaches it, and puts the system prompt in the engine's cache for
    # both runs alike.
    warm = {**chat_body(-1), "max_tokens": 32}
    assert http("POST", f"{gateway.url}/v1/chat/completions", warm).status == 200
    wait_idle(gateway)

    direct = load(engine, engine.url, engine_idle(engine))
    through = load(engine, gateway.url, lambda: wait_idle(gateway))
    report = f"straight: {direct}; through the gateway: {through}"
    print(report)
    assert direct.statuses == [200] * REQUESTS and through.statuses == [200] * REQUESTS, report
    assert direct.preemptions > 0, report
    assert direct.hit_rate > 0.5, report
    assert through.preemptions == 0, report
    assert through.kv_peak >= KV_PEAK_FLOOR, report
    assert through.tokens_per_second >= THROUGHPUT_FLOOR * direct.tokens_per_second, report
