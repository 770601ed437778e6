"""Two backlogged tenants whose requests differ 30x in size: `python -m bench.protection.fairness`.

The local stack (simulator, sidecar, Envoy, exporter; lean profile) with a 16,384-token KV cache, the KV
budget binding and slots raised so only it decides. Tenant `short` runs 64 clients of ~100-token prompts,
tenant `long` 8 clients of ~3,000-token prompts; every request asks for 300 output tokens (the simulator
generates exactly that), so each tenant alone asks for more than the whole cache. Every client sends a
streamed chat, honours `retry-after-ms` on a 429 and sends again, for `--seconds` (40). Three runs:

* `unfair`: `kv_budget.fair_shares: false` (whatever fits now is admitted);
* `fair`: the shipped default (docs/tenants.md "Fair shares of the KV cache");
* `alone`: the long tenant by itself, its TTFT with the cache to itself.

Reported per run: each tenant's admitted KV (prompt + output tokens of requests admitted) over the run and
over each 10 s window, as a share of both tenants'; requests answered; the long tenant's TTFT p50/p99 from
its first attempt (retries included) to its first content event. Results: bench/results/fairness-sim.json.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from bench.common import percentile, write_json
from tests.support.stack import fixed_step_sim, metric, start_stack
from tests.support.waiting import wait_for

MODEL = "llama-3-8b"
OUTPUT = 300
TENANTS = {"short": (64, 100), "long": (8, 3000)}
"""Tenant: (clients, prompt tokens): one ' hello' is one token, and the chat template adds a few."""
WINDOW_S = 10.0
SEED = 7
SIM_ARGS = fixed_step_sim(MODEL, 20, "--num-gpu-blocks", "1024", "--max-model-len", "4096")
"""1,024 blocks of 16 tokens; a 20 ms decode step whatever the batch: 300 tokens stream in 6 s."""


def config(fair: bool) -> dict[str, Any]:
    return {
        "admission": {"tenant": {"header": "x-tenant-id"}},
        "models": {"*": {"context_window": 4096, "default_max_tokens": OUTPUT}},
        "limits": {"global": {"max_concurrency": 512}},
        "kv_budget": {"enabled": True, "target_utilization": 0.9, "fair_shares": fair},
    }


@dataclass
class Tally:
    """What one run's clients saw."""

    admitted: list[tuple[float, str, int]] = field(default_factory=list)  # (seconds in, tenant, KV tokens)
    held: list[tuple[float, float, str, int]] = field(default_factory=list)  # (admitted, ended, tenant, KV)
    ttft: dict[str, list[float]] = field(default_factory=lambda: {t: [] for t in TENANTS})
    refusals: int = 0


async def client(
    session: aiohttp.ClientSession,
    url: str,
    who: tuple[str, int],
    prompt: int,
    until: float,
    start: float,
    tally: Tally,
) -> None:
    tenant, number = who
    headers = {"x-tenant-id": tenant}
    sent = 0
    while time.monotonic() < until:
        sent += 1
        # A head of its own: prompts share no prefix (the budget would book a shared one once).
        content = f"{tenant} {number} {sent}:" + " hello" * prompt
        body = {
            "model": MODEL,
            "max_tokens": OUTPUT,
            "stream": True,
            "messages": [{"role": "user", "content": content}],
        }
        first_try = time.monotonic()
        while time.monotonic() < until:
            async with session.post(f"{url}/v1/chat/completions", json=body, headers=headers) as resp:
                if resp.status == 429:
                    tally.refusals += 1
                    wait_ms = float(resp.headers.get("retry-after-ms", "1000"))
                    await resp.read()
                    await asyncio.sleep(min(wait_ms / 1000, max(0.0, until - time.monotonic())))
                    continue
                resp.raise_for_status()
                admitted_at = time.monotonic() - start
                tally.admitted.append((admitted_at, tenant, prompt + OUTPUT))
                async for line in resp.content:
                    if line.startswith(b"data: {") and b'"content"' in line:
                        tally.ttft[tenant].append(time.monotonic() - first_try)
                        break
                async for _ in resp.content.iter_any():
                    pass
                tally.held.append((admitted_at, time.monotonic() - start, tenant, prompt + OUTPUT))
            break


async def drive(url: str, tenants: dict[str, tuple[int, int]], seconds: float) -> Tally:
    tally = Tally()
    start = time.monotonic()
    until = start + seconds
    limits = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=limits, timeout=aiohttp.ClientTimeout(total=300)) as session:
        # Clients start in a seeded random order: started tenant by tenant, the first tenant's flood would
        # fill the empty cache before the other sent anything, a head start no admission rule can undo
        # without preempting (the gateway never does).
        everyone = [
            (tenant, number, prompt)
            for tenant, (clients, prompt) in tenants.items()
            for number in range(clients)
        ]
        random.Random(SEED).shuffle(everyone)
        await asyncio.gather(
            *(
                client(session, url, (tenant, number), prompt, until, start, tally)
                for tenant, number, prompt in everyone
            )
        )
    return tally


def held_shares(tally: Tally, seconds: float) -> tuple[float, list[float]]:
    """The long tenant's share of the KV service, KV-token seconds held (admission to the stream's end) by
    both tenants, over the run and per window: what the cache gave each, whenever it was admitted."""
    windows = [(i * WINDOW_S, (i + 1) * WINDOW_S) for i in range(int(seconds // WINDOW_S))]

    def held(tenant: str, low: float, high: float) -> float:
        return sum(
            kv * max(0.0, min(end, high) - max(start, low))
            for start, end, who, kv in tally.held
            if who == tenant
        )

    def share(low: float, high: float) -> float:
        long, short = held("long", low, high), held("short", low, high)
        return round(long / ((long + short) or 1), 3)

    return share(0.0, seconds), [share(low, high) for low, high in windows]


def figures(tally: Tally, seconds: float) -> dict[str, Any]:
    total = {t: sum(kv for _, tenant, kv in tally.admitted if tenant == t) for t in TENANTS}
    both = sum(total.values()) or 1
    windows = []
    for index in range(int(seconds // WINDOW_S)):
        low, high = index * WINDOW_S, (index + 1) * WINDOW_S
        got = {
            t: sum(kv for at, tenant, kv in tally.admitted if tenant == t and low <= at < high)
            for t in TENANTS
        }
        windows.append(round(got["long"] / (sum(got.values()) or 1), 3))
    held_share, held_windows = held_shares(tally, seconds)
    durations = {t: [end - start for start, end, who, _ in tally.held if who == t] for t in TENANTS}
    return {
        "held_kv_tokens_mean": round(
            sum(kv * (min(end, seconds) - start) for start, end, _, kv in tally.held if start < seconds)
            / seconds
        ),
        "seconds_held_p50": {t: round(percentile(d, 50), 1) for t, d in durations.items()},
        "long_kv_seconds_share": held_share,
        "long_kv_seconds_share_per_10s": held_windows,
        "long_share": round(total["long"] / both, 3),
        "long_share_per_10s": windows,
        "admitted": {t: sum(1 for _, tenant, _ in tally.admitted if tenant == t) for t in TENANTS},
        "admitted_kv_tokens": total,
        "refusals": tally.refusals,
        "long_ttft_p50_s": round(percentile(tally.ttft["long"], 50), 2),
        "long_ttft_p99_s": round(percentile(tally.ttft["long"], 99), 2),
        "short_ttft_p99_s": round(percentile(tally.ttft["short"], 99), 2),
    }


def run(mode: str, seconds: float) -> dict[str, Any]:
    stack = start_stack(config(mode != "unfair"), SIM_ARGS, "lean", with_exporter=True)
    try:
        capacity = functools.partial(metric, f"{stack.admin_url}/metrics", "extproc_kv_capacity_tokens")
        wait_for(lambda: capacity(pool=MODEL) > 0, 20, "the pool's KV capacity from the feed")
        tenants = {"long": TENANTS["long"]} if mode == "alone" else TENANTS
        tally = asyncio.run(drive(stack.envoy_url, tenants, seconds))
        return {"mode": mode, **figures(tally, seconds)}
    finally:
        stack.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.protection.fairness", description=__doc__)
    parser.add_argument("--seconds", type=float, default=40.0)
    parser.add_argument("--modes", default="unfair,fair,alone")
    args = parser.parse_args(argv)
    rows = []
    for mode in args.modes.split(","):
        row = run(mode, args.seconds)
        print(f"fairness {mode}: {row}", flush=True)
        rows.append(row)
    write_json("fairness-sim.json", {"seconds": args.seconds, "tenants": TENANTS, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
