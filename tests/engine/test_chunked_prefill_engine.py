"""Chunked prefill on the real engine (issue 40, item 3): a prompt longer than the engine's step budget is
prefilled over many steps, and while it is, vLLM counts it running and holds only its computed chunks. The
KV budget's downward correction must not read that as a lease holding less than its prompt: it takes KV off
a lease only once the engine's prompt counter (`vllm:prompt_tokens_total`, grown by a prompt's whole length
when its prefill completes) has grown by its prompt since its admission. By the older rule ("admitted more
than `settle_after` ago, nothing waiting"), the gateway took the uncomputed part off at each sample of the
prefill, and a second long prompt could then be admitted into room the first still needs.

This module runs an engine of its own that prefills one token a step (`--max-num-batched-tokens 1`): a prompt
near the model's window (8,192) then takes 8,000 steps, seconds even for the tier's tiny model (it runs a step
in well under a millisecond: 7,000 tokens in 16-token chunks were prefilled within 0.3 s), and the feed
samples it mid-prefill. The engine freezes this two-core host while it runs (a sampler of the sidecar's
gauges got one reading in 33 s), so the test asserts what the correction decides, the second prompt's fate.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.parse
from collections.abc import Iterator
from http.client import HTTPConnection

import pytest

from extproc.admission.replies.refusals import REASON_HEADER
from extproc.sim.textgen import generate_tokens
from tests.engine.stacks import prefix_config, start_gateway
from tests.support.engine import CACHE_TOKENS, ENGINE_TEST_TIMEOUT_S, MODEL, Engine, running_engine
from tests.support.stack import Stack, http

pytestmark = [pytest.mark.engine, pytest.mark.timeout(ENGINE_TEST_TIMEOUT_S)]

CHUNK_TOKENS = 1
PROMPT_TOKENS = 8_000
SETTLED_AFTER_S = 2.5
"""Past the budget's `settle_after` (2 s): from here a feed sample corrects the first prompt's lease."""


def fed_samples(gateway: Stack, count: int, limit_s: float = 60.0) -> None:
    """Until the sidecar has taken in `count` more feed samples (each a correction of the pool's leases)."""
    target = gateway.sidecar("extproc_feed_samples_total") + count
    deadline = time.monotonic() + limit_s
    while gateway.sidecar("extproc_feed_samples_total") < target:
        assert time.monotonic() < deadline, f"fewer than {count} feed samples in {limit_s} s"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def chunked_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    flags = ("--max-num-batched-tokens", str(CHUNK_TOKENS), "--max-num-seqs", str(CHUNK_TOKENS))
    with running_engine(tmp_path_factory.mktemp("chunked"), *flags) as engine:
        yield engine


@pytest.fixture(scope="module")
def gateway(chunked_engine: Engine) -> Iterator[Stack]:
    stack = start_gateway(chunked_engine, prefix_config(), "lean", with_exporter=True)
    try:
        yield Stack(stack)
    finally:
        stack.stop()


def first_token_after(url: str, body: dict[str, object], sent: float) -> float:
    """Stream `body` to `url`'s completions, read to its end: seconds from `sent` to its first data event."""
    parts = urllib.parse.urlsplit(url)
    conn = HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=300)
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), {"content-type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200, resp.read()
        first = None
        for line in resp:
            if first is None and line.startswith(b"data:"):
                first = time.monotonic() - sent
        assert first is not None, "no data event"
        return first
    finally:
        conn.close()


def warm_up(gateway: Stack) -> None:
    """Until the feed reports the engine's cache, then one short stream: the pool's decode pace learned, the
    engine's kernels warm."""
    deadline = time.monotonic() + 60
    while gateway.sidecar("extproc_kv_capacity_tokens") != CACHE_TOKENS:
        assert time.monotonic() < deadline, "the KV feed never reported the engine's capacity"
        time.sleep(0.2)
    warm = {"model": MODEL, "prompt": "warm up", "max_tokens": 16, "stream": True}
    assert http("POST", f"{gateway.url}/v1/completions", warm).status == 200


def long_prompt(seed: str) -> dict[str, object]:
    return {
        "model": MODEL,
        "prompt": "".join(generate_tokens(PROMPT_TOKENS, seed)),
        "max_tokens": 16,
        "stream": True,
    }


def test_a_prompt_in_chunked_prefill_keeps_its_room(chunked_engine: Engine, gateway: Stack) -> None:
    """A second long prompt sent while the first is still being prefilled, once two feed samples corrected
    the first's lease past `settle_after`, does not fit beside it, 8,016 + 8,016 tokens over the 14,745 of
    the budget's target: refused, `kv_budget`. By the older rule the first's uncomputed part was taken off
    at each sample and the second was admitted into room the first still needs."""
    warm_up(gateway)
    sent = time.monotonic()
    first: list[float] = []
    sender = threading.Thread(
        target=lambda: first.append(first_token_after(gateway.url, long_prompt("a"), sent))
    )
    sender.start()
    time.sleep(SETTLED_AFTER_S)
    fed_samples(gateway, 2)
    second_at = time.monotonic() - sent
    second = http("POST", f"{gateway.url}/v1/completions", long_prompt("b"), timeout_s=300)
    sender.join()
    print(
        f"the second sent {second_at:.1f} s after the first, answered {second.status} "
        f"({second.headers.get(REASON_HEADER, '')}); the first's first token after {first[0]:.1f} s"
    )
    assert first[0] > second_at, "the first prompt's prefill ended before the second came: nothing was tested"
    assert second.status == 429 and second.headers.get(REASON_HEADER) == "kv_budget", second.status
