"""Record the adaptive controller at work and plot it: KV usage, scale and admitted load over time.

Starts the local stack with an exporter (simulator with a small KV cache so that the load below fills it),
drives open-loop streaming traffic through Envoy for `--load-seconds`, then lets it drain, sampling the
simulator's and the sidecar's metrics every 200 ms. Writes a CSV and a PNG (default: docs/img/).

    python scripts/record_feedback_run.py            # about a minute
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import random
import time
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from devstack.processes import Ports
from devstack.stack import LocalStack
from extproc.envoyconf.profiles import REPO

MODEL = "llama-3-8b"
CONFIG: dict[str, Any] = {
    "models": {"*": {"context_window": 8192, "default_max_tokens": 512}},
    "limits": {"models": {MODEL: {"max_concurrency": 40}}},
    "adaptive": {"low_watermark": 0.70, "high_watermark": 0.85, "min_scale": 0.6, "recovery_per_second": 0.1},
}
# 1,536 blocks x 16 = 24,576 KV tokens: forty ~1,100-token sequences would need ~44k.
SIM_ARGS = [
    "--model",
    MODEL,
    "--num-gpu-blocks",
    "1536",
    "--step-base-ms",
    "12",
    "--decode-per-seq-ms",
    "0.2",
]


def _values(text: str, wanted: dict[str, dict[str, str]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            for name, labels in wanted.items():
                if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                    out[name] = out.get(name, 0.0) + float(sample.value)
    return out


async def sample(session: aiohttp.ClientSession, stack: LocalStack) -> dict[str, float]:
    async with session.get(f"{stack.upstream_url}/metrics") as r:
        sim = _values(
            await r.text(),
            {
                "vllm:kv_cache_usage_perc": {},
                "vllm:num_requests_running": {},
                "vllm:num_requests_waiting": {},
                "vllm:num_preemptions_total": {},
            },
        )
    async with session.get(f"{stack.admin_url}/metrics") as r:
        side = _values(
            await r.text(),
            {
                "extproc_adaptive_scale_ratio": {"pool": MODEL},
                "extproc_limit_concurrency": {"key": f"model:{MODEL}"},
                "extproc_active_requests": {},
                "extproc_requests_total": {"decision": "rejected"},
            },
        )
    return {**sim, **side}


async def one_request(session: aiohttp.ClientSession, url: str, rng: random.Random) -> None:
    body = {
        "model": MODEL,
        "max_tokens": rng.randint(400, 900),
        "stream": True,
        "messages": [{"role": "user", "content": " word" * rng.randint(200, 600)}],
    }
    try:
        async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
            async for _ in resp.content.iter_any():
                pass
    except (aiohttp.ClientError, TimeoutError):
        pass


async def run(args: argparse.Namespace, stack: LocalStack) -> list[dict[str, float]]:
    rng = random.Random(7)
    rows: list[dict[str, float]] = []
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        start = time.monotonic()
        tasks: set[asyncio.Task[None]] = set()

        async def load() -> None:
            next_at = time.monotonic()
            while time.monotonic() - start < args.load_seconds:
                next_at += rng.expovariate(args.rate)
                await asyncio.sleep(max(0.0, next_at - time.monotonic()))
                task = asyncio.create_task(one_request(session, stack.envoy_url, rng))
                tasks.add(task)
                task.add_done_callback(tasks.discard)

        loader = asyncio.create_task(load())
        while time.monotonic() - start < args.load_seconds + args.drain_seconds:
            row = await sample(session, stack)
            row["t"] = round(time.monotonic() - start, 2)
            rows.append(row)
            await asyncio.sleep(0.2)
        await loader
        for task in list(tasks):
            task.cancel()
    return rows


def plot(rows: list[dict[str, float]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [r["t"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 6.5), sharex=True)
    ax1.plot(t, [r.get("vllm:kv_cache_usage_perc", 0) for r in rows], label="KV-cache usage (simulator)")
    ax1.plot(t, [r.get("extproc_adaptive_scale_ratio", 0) for r in rows], label="adaptive scale (sidecar)")
    ax1.axhline(0.85, color="red", linestyle=":", linewidth=1, label="high watermark 0.85")
    ax1.axhline(0.70, color="green", linestyle=":", linewidth=1, label="low watermark 0.70")
    ax1.set_ylim(0, 1.05)
    ax1.set_ylabel("ratio")
    ax1.legend(loc="lower right", fontsize=8)
    ax2.plot(t, [r.get("extproc_limit_concurrency", 0) for r in rows], label="effective concurrency limit")
    ax2.plot(t, [r.get("extproc_active_requests", 0) for r in rows], label="admitted, in flight")
    ax2.plot(t, [r.get("vllm:num_requests_waiting", 0) for r in rows], label="queued in the engine")
    ax2.set_xlabel("seconds")
    ax2.set_ylabel("requests")
    ax2.legend(loc="upper right", fontsize=8)
    fig.suptitle("KV feedback: limits shrink as the cache fills and recover as it drains")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rate", type=float, default=6.0, help="request arrivals per second while loading")
    parser.add_argument("--load-seconds", type=float, default=30.0)
    parser.add_argument("--drain-seconds", type=float, default=25.0)
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "img")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    stack = LocalStack(ports=Ports.free(), sidecar_config=CONFIG, sim_args=SIM_ARGS, with_exporter=True)
    stack.start()
    try:
        time.sleep(6)  # let the feed become fresh and the scale recover from its safe start
        rows = asyncio.run(run(args, stack))
    finally:
        stack.stop()
    keys = sorted({k for r in rows for k in r}, key=lambda k: (k != "t", k))
    with open(args.out / "feedback_run.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        writer.writerows(rows)
    plot(rows, args.out / "feedback_run.png")
    peak = max(r.get("vllm:kv_cache_usage_perc", 0) for r in rows)
    low = min(r.get("extproc_adaptive_scale_ratio", 1) for r in rows)
    print(
        f"wrote {args.out}/feedback_run.png: peak KV {peak:.2f}, lowest scale {low:.2f}, {len(rows)} samples"
    )


if __name__ == "__main__":
    main()
