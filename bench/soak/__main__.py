"""`python -m bench.soak [--requests N] [--seed S]`: see `bench.soak.main`."""

from __future__ import annotations

import argparse
import signal
import sys

from bench.soak.main import run


def _exit_on_signal(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__)
    parser.add_argument("--requests", type=int, default=100_000, help="requests to send (default 100,000)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--abandon", type=float, default=0.10, help="share of requests the client abandons")
    parser.add_argument(
        "--on-unavailable",
        choices=("local", "reject"),
        default="local",
        help="the replicas' store.on_unavailable",
    )
    parser.add_argument("--keep", action="store_true", help="report the work directory (logs, configs)")
    args = parser.parse_args()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _exit_on_signal)  # unwind through the `finally` that stops every process
    return run(args.requests, args.seed, args.keep, args.abandon, args.on_unavailable)


if __name__ == "__main__":
    sys.exit(main())
