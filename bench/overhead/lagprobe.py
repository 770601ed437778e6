"""The sidecar with a loop-lag probe: `python -m bench.overhead.lagprobe --config P --out F`.

With `--releases R` instead of `--out`, no heartbeat runs (it costs CPU): each lease settlement's wall time
is recorded and written to R on exit, so the benchmark can pair a stream's last byte at the client with the
release of its slot (bench/overhead/profiles.py).

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
import os
import time
from pathlib import Path
from typing import Any

from extproc.admission.capacity.settler import Settler
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


def record_releases(releases: list[float]) -> None:
    """Wrap the one place every lease settles, to note when."""
    settle = Settler.settle

    def timed(self: Settler, admitted: Any, charge: Any) -> Any:
        releases.append(time.time())
        return settle(self, admitted, charge)

    Settler.settle = timed  # type: ignore[method-assign]


async def main(config: Path, samples: list[tuple[float, float]] | None) -> None:
    if samples is None:
        await serve(config)
        return
    probe = asyncio.create_task(heartbeat(samples))
    try:
        await serve(config)
    finally:
        probe.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await probe


UVLOOP_ENV = "EXTPROC_BENCH_UVLOOP"
"""Set to 1 (bench/overhead/hotpath.py --uvloop) to run the sidecar on uvloop's event loop instead of
asyncio's: what the loop implementation changes in the per-request cost (`pip install uvloop`)."""


if __name__ == "__main__":
    if os.environ.get(UVLOOP_ENV) == "1":
        import uvloop  # type: ignore[import-not-found, unused-ignore]  # optional: pip install uvloop

        uvloop.install()
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument("--out", type=Path, default=None, help="loop-lag samples")
    parser.add_argument("--releases", type=Path, default=None, help="settlement times")
    args = parser.parse_args()
    setup_logging(load_config(args.config).log_level)
    collected: list[tuple[float, float]] = []
    releases: list[float] = []
    if args.releases is not None:
        record_releases(releases)
    try:
        asyncio.run(main(args.config, collected if args.out is not None else None))
    finally:
        if args.out is not None:
            args.out.write_text(json.dumps(collected))
        if args.releases is not None:
            args.releases.write_text(json.dumps(releases))
