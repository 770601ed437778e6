"""Requests with first-token deadlines against a full queue: `python -m bench.protection.deadlines`.

The issue's target (issue 28, item 3): of the requests that carry a deadline, at least 99 % either meet
it or are refused within 50 ms of arriving. The local stack (simulator, sidecar, Envoy) with 4 slots and a
class that queues for up to 8 s; the simulator streams 100 tokens a second per sequence whatever the batch
(`fixed_step_sim`, 10 ms), so a request's run is its `max_tokens` / 100 s. `--requests` (200) streamed
chats arrive as a Poisson process of `--rate` per second, each with `ignore_eos`, 30-150 output tokens and
`x-extproc-ttft-deadline-ms` drawn from 300-4,000 ms (a fixed seed: every run sends the same requests).
The 4 slots finish about 4.4 such requests a second: `--rate 6` is ~1.4x the capacity, 40 ~10x.

Each request counts once: met (admitted, its first content event within its deadline), refused in time
(a 429 within 50 ms of sending it), refused late (a 429 after 50 ms: a wait its deadline ended), or missed
(admitted, first token late). Results: bench/results/deadlines-<profile>.json, one row per rate.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from bench.common import percentile, write_json
from tests.support.stack import fixed_step_sim, start_stack

MODEL = "llama-3-8b"
SLOTS = 4
REFUSED_IN_TIME_S = 0.05
CONFIG: dict[str, Any] = {
    "classes": [{"name": "standard", "queue": {"max_wait_seconds": 8, "max_queued": 500}}],
    "default_class": "standard",
    "models": {"*": {"context_window": 4096, "default_max_tokens": 64}},
    "limits": {"global": {"max_concurrency": SLOTS}},
}
SIM_ARGS = fixed_step_sim(MODEL, 10)


@dataclass
class Tally:
    """What the clients saw: per request its outcome and how long it took to learn it."""

    outcomes: dict[str, int] = field(
        default_factory=lambda: {"met": 0, "refused_in_time": 0, "refused_late": 0, "missed": 0}
    )
    refusal_s: list[float] = field(default_factory=list)
    ttft_s: list[float] = field(default_factory=list)


async def one(session: aiohttp.ClientSession, url: str, deadline_ms: int, tokens: int, tally: Tally) -> None:
    body = {
        "model": MODEL,
        "max_tokens": tokens,
        "ignore_eos": True,
        "stream": True,
        "messages": [{"role": "user", "content": "x"}],
    }
    headers = {"x-extproc-ttft-deadline-ms": str(deadline_ms)}
    started = time.monotonic()
    async with session.post(f"{url}/v1/chat/completions", json=body, headers=headers) as resp:
        if resp.status != 200:
            await resp.read()
            took = time.monotonic() - started
            tally.refusal_s.append(took)
            tally.outcomes["refused_in_time" if took <= REFUSED_IN_TIME_S else "refused_late"] += 1
            return
        first: float | None = None
        async for line in resp.content:
            if first is None and line.startswith(b"data: {") and b'"content"' in line:
                first = time.monotonic() - started
        in_time = first is not None and first * 1000 <= deadline_ms
        tally.outcomes["met" if in_time else "missed"] += 1
        if first is not None:
            tally.ttft_s.append(first)


async def drive(url: str, rate: float, requests: int) -> Tally:
    tally = Tally()
    draw = random.Random(7)
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
        sent = []
        for _ in range(requests):
            deadline, tokens = draw.randint(300, 4000), draw.randint(30, 150)
            sent.append(asyncio.create_task(one(session, url, deadline, tokens, tally)))
            await asyncio.sleep(draw.expovariate(rate))
        await asyncio.gather(*sent)
    return tally


def figures(tally: Tally, rate: float) -> dict[str, Any]:
    total = sum(tally.outcomes.values()) or 1
    good = tally.outcomes["met"] + tally.outcomes["refused_in_time"]
    return {
        "rate_per_s": rate,
        **tally.outcomes,
        "met_or_refused_in_time": round(good / total, 3),
        "refusal_ms_p50_p90_p99": [round(percentile(tally.refusal_s, q) * 1000) for q in (50, 90, 99)],
        "ttft_s_p50_p99": [round(percentile(tally.ttft_s, q), 2) for q in (50, 99)],
    }


def run(profile: str, rate: float, requests: int) -> dict[str, Any]:
    stack = start_stack(CONFIG, SIM_ARGS, profile)
    try:
        return figures(asyncio.run(drive(stack.envoy_url, rate, requests)), rate)
    finally:
        stack.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.protection.deadlines", description=__doc__)
    parser.add_argument("--profile", default="lean", choices=("lean", "inline"))
    parser.add_argument("--rates", default="6,40", help="arrivals per second, one run each")
    parser.add_argument("--requests", type=int, default=200)
    args = parser.parse_args(argv)
    rows = []
    for rate in (float(r) for r in args.rates.split(",")):
        row = run(args.profile, rate, args.requests)
        print(f"deadlines {args.profile} {rate:g}/s: {row}", flush=True)
        rows.append(row)
    write_json(f"deadlines-{args.profile}.json", {"slots": SLOTS, "requests": args.requests, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
