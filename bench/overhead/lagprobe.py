"""The sidecar with a loop-lag probe: `python -m bench.overhead.lagprobe --config P --out F`.

A heartbeat task sleeps 5 ms and records how late it wakes up. Anything that holds the loop (a body parsed
inline, a tokenizer call that does not release the GIL, a slow settlement) shows up as lag that every other
stream on that loop sees too. On exit (SIGTERM) the samples, `[wall time, lag ms]`, are written to F so the
benchmark can cut them by phase.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import time
from pathlib import Path

from extproc.app import serve
from extproc.config import load_config
from extproc.logs import setup_logging

PERIOD_S = 0.005


async def heartbeat(samples: list[tuple[float, float]]) -> None:
    loop = asyncio.get_running_loop()
    while True:
        t0 = loop.time()
        await asyncio.sleep(PERIOD_S)
        lag = loop.time() - t0 - PERIOD_S
        samples.append((time.time(), round(lag * 1000, 3)))


async def main(config: Path, samples: list[tuple[float, float]]) -> None:
    probe = asyncio.create_task(heartbeat(samples))
    try:
        await serve(config)
    finally:
        probe.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await probe


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    setup_logging(load_config(args.config).log_level)
    collected: list[tuple[float, float]] = []
    try:
        asyncio.run(main(args.config, collected))
    finally:
        args.out.write_text(json.dumps(collected))
