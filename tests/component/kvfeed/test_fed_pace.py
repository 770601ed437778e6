"""A pool whose end reports never arrive is charged at the engine's own pace, read off the KV feed.

The simulator runs 20 tokens/s per sequence (a 50 ms decode step) and exposes vLLM's
`vllm:generation_tokens_total` and `vllm:num_requests_running`; the sidecar's feed loop scrapes it directly.
No stream completes (as with Envoy's access log to the sidecar down), so no rate is learned: the expiry
charge of a lease must come from the fed pace, within 1.5x of the tokens the engine generated, where the
assumed 100 tokens/s is 5x off.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import replace

import aiohttp
import pytest

from extproc.core.engine.adaptive import AdaptiveConfig
from extproc.core.engine.pace import PoolPaces, RateSource
from extproc.kvfeed.subscriber.loop import FeedbackLoop
from extproc.kvfeed.subscriber.settings import SubscriberConfig
from extproc.kvfeed.targets import Target
from extproc.sim.config import SimConfig
from extproc.sim.scheduler import StepTiming
from extproc.sim.server import SimServer

POOL = "llama-3-8b"
ENGINE_PACE = 20.0  # tokens/s per sequence: one token per 50 ms step, whatever the batch
STREAMS = 4
ANSWER = 80  # tokens per answer: 4 s at the engine's pace
RESERVED = 2000  # each request's reservation: what caps the charge


@pytest.fixture
async def sim() -> AsyncIterator[SimServer]:
    timing = StepTiming(base_s=1 / ENGINE_PACE, per_seq_s=0.0, per_prefill_token_s=0.0)
    server = SimServer(replace(SimConfig(port=0, seed=1), timing=timing, time_scale=1.0))
    await server.start()
    yield server
    await server.stop()


async def answer(session: aiohttp.ClientSession, url: str) -> tuple[float, int]:
    """One streamed answer of ANSWER tokens: (seconds from sending to its last byte, tokens received)."""
    body = {
        "model": POOL,
        "messages": [{"role": "user", "content": "Tell me a long story."}],
        "max_tokens": ANSWER,
        "stream": True,
    }
    sent, tokens = time.monotonic(), 0
    async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
        assert resp.status == 200
        async for line in resp.content:
            if line.startswith(b"data: {"):
                choices = json.loads(line[len(b"data: ") :]).get("choices") or [{}]
                tokens += bool(choices[0].get("delta", {}).get("content"))
    return time.monotonic() - sent, tokens


async def test_a_lease_whose_end_report_never_came_is_charged_at_the_fed_pace(sim: SimServer) -> None:
    """Each request is charged `time to its stream end x the pool's rate`: the fed pace, as no stream
    completed here (no end report), within 1.5x of the tokens generated; the assumed rate is 5x off."""
    loop = FeedbackLoop(
        SubscriberConfig(direct_targets=(Target(f"{sim.url}/metrics"),), scrape_interval=0.25),
        {POOL: AdaptiveConfig()},
        time.monotonic,
    )
    rates = PoolPaces(default_tokens_per_second=100.0, fed=loop.decode_tokens_per_second)
    await loop.start()
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
            ended = await asyncio.gather(*(answer(session, sim.url) for _ in range(STREAMS)))
        await asyncio.sleep(1.0)  # the engine is idle now: its pace must stay known for the charge
        assert not rates.learned(POOL) and rates.source(POOL) is RateSource.FED
        fed = rates.rate(POOL)
        for elapsed, tokens in ended:
            assert tokens == ANSWER
            charged = rates.estimate(POOL, elapsed, 1, RESERVED)
            assumed = PoolPaces(default_tokens_per_second=100.0).estimate(POOL, elapsed, 1, RESERVED)
            assert tokens / 1.5 <= charged <= tokens * 1.5, (charged, tokens, fed, elapsed)
            assert assumed > tokens * 1.5, (assumed, tokens)  # without the feed: the overcharge guarded
    finally:
        await loop.stop()
