"""`python -m bench --short | --full [--only protection,overhead,micro,soak] [--requests N]`.

--short (`make bench`, under five minutes): protection at 4x in the preempt mode for the Envoy-only,
static and feedback modes on 400 requests; overhead with fewer requests and rates; micro with few rounds.
--full (`make bench-full`): everything RESULTS.md reports.
soak (only when named in --only): 3 replicas, one Redis, faults under load (`bench/soak`); 5,000 requests
with --short, 100,000 with --full, or --requests N.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

from bench.common import REPO, RESULTS, machine, write_json

PARTS = ("protection", "overhead", "micro")
OPTIONAL_PARTS = ("soak", "fleet")


def run_micro(short: bool) -> int:
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"micro{'-short' if short else ''}.json"
    argv = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        str(REPO / "bench" / "micro"),
        "--benchmark-only",
        f"--benchmark-json={out}",
        "--benchmark-columns=min,median,mean,max,rounds",
    ]
    if short:
        argv += ["--benchmark-max-time=0.2", "--benchmark-min-rounds=3"]
    code = subprocess.run(argv, cwd=REPO, timeout=600).returncode
    _trim_micro(out)
    return code


def _trim_micro(path: Path) -> None:
    """pytest-benchmark stores every round's timing (megabytes); keep the statistics only."""
    if not path.is_file():
        return
    data = json.loads(path.read_text())
    for bench in data.get("benchmarks", []):
        bench["stats"].pop("data", None)
    data.pop("commit_info", None)
    path.write_text(json.dumps(data, indent=1) + "\n")


def _exit_on_signal(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--short", action="store_true", help="reduced run, under five minutes (default)")
    size.add_argument("--full", action="store_true", help="the full run RESULTS.md reports")
    parser.add_argument(
        "--only", default=",".join(PARTS), help="comma-separated: " + ",".join(PARTS + OPTIONAL_PARTS)
    )
    parser.add_argument("--requests", type=int, default=None, help="soak: requests to send")
    args = parser.parse_args(argv)
    # SIGTERM (and SIGINT, which a shell ignores in background jobs) unwind through the `finally` blocks
    # that stop every process a benchmark started.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _exit_on_signal)
    short = not args.full
    parts = [p.strip() for p in args.only.split(",") if p.strip()]
    unknown = set(parts) - set(PARTS + OPTIONAL_PARTS)
    if unknown:
        parser.error(f"unknown part(s): {', '.join(sorted(unknown))}")
    info = machine()
    durations: dict[str, float] = {}
    status = 0
    for part in parts:
        t0 = time.monotonic()
        if part == "protection":
            from bench.protection.main import run as run_protection

            run_protection(short)
        elif part == "overhead":
            from bench.overhead.main import run as run_overhead
            from bench.overhead.profiles import run as run_profiles

            run_overhead(short)
            run_profiles(short)
        elif part == "micro":
            status |= run_micro(short)
        elif part == "soak":
            from bench.soak.main import run as run_soak

            status |= run_soak(args.requests or (5_000 if short else 100_000))
        elif part == "fleet":  # issue 39: gateway replicas sharing one pool's KV cache, ~12 min
            from bench.fleet import main as run_fleet

            status |= run_fleet([])
        durations[part] = round(time.monotonic() - t0, 1)
        print(f"bench: {part} took {durations[part]:.0f} s", flush=True)
    write_json(
        f"run{'-short' if short else ''}-{'-'.join(parts)}.json",
        {"machine": info, "short": short, "durations_s": durations, "argv": sys.argv},
    )
    return status


if __name__ == "__main__":
    sys.exit(main())
