"""Added latency of admission on a bound (docs/admission.md): `python -m bench.overhead.bound [--repeat N]`.

Stacks from `profiles.py` (lean profile, the shipped config/local.yaml with its KV feed and KV budget), one
after another: plain Envoy, the lean no-op processor, and the sidecar with `admission.bound_admission` on and
off, in the shipped 8k window and with llama-3-8b's window raised to 32k. Phases (one client, sequential):

* `seq_1k` (8k window): 1k-token prompts, where the bound decides;
* `seq_near` (8k window): 1.7k-token prompts whose byte bound (~8.4 kB) passes the window, so the exact count
  decides, with the option on or off;
* `seq_4k` (32k window): 4k-token prompts, where the bound decides.

Added latency = p50 minus plain Envoy's p50 in the same run; the ratio to the no-op's added latency is the
1.3x target of the benchmark. The machine is shared: compare within one run, and repeat.

`--pin` gives the processor (no-op or sidecar, all its threads) the last CPU to itself and puts Envoy, the
upstream, the exporter and the load generator on the others, as a pod's CPU request separates the sidecar
from the rest of the node: the exact count after a bound verdict then competes only with the sidecar's own
idle loop.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import os
import statistics
import time
from typing import Any

from bench.common import percentile, write_json
from bench.overhead import profiles
from bench.overhead.hotpath import sidecar_timings
from bench.overhead.profiles import Stack, Variant, chat, measured
from extproc.admission.exchange import Exchange, RequestHead
from extproc.admission.replies.verdicts import Forward
from extproc.app import Sidecar
from extproc.config import parse_config
from extproc.core.clock import FakeClock
from extproc.metrics import Metrics
from extproc.store.local import LocalStore

NEAR_TOKENS = 1700
CPUS = sorted(os.sched_getaffinity(0))
"""The CPUs this run may use, read before `--pin` narrows this process's own set."""
SHIPPED = profiles.shipped

STACKS: tuple[tuple[str, Variant, dict[str, Any] | None, tuple[str, ...]], ...] = (
    ("envoy", Variant("none"), None, ("seq_1k", "seq_near", "seq_4k")),
    ("noop-lean", Variant("noop", "lean"), None, ("seq_1k", "seq_near", "seq_4k")),
    (
        "bound-on-8k",
        Variant("sidecar", "lean", "shipped"),
        {"window": 8192, "bound": True},
        ("seq_1k", "seq_near"),
    ),
    (
        "bound-off-8k",
        Variant("sidecar", "lean", "shipped"),
        {"window": 8192, "bound": False},
        ("seq_1k", "seq_near"),
    ),
    ("bound-on-32k", Variant("sidecar", "lean", "shipped"), {"window": 32768, "bound": True}, ("seq_4k",)),
    ("bound-off-32k", Variant("sidecar", "lean", "shipped"), {"window": 32768, "bound": False}, ("seq_4k",)),
)
BODIES = {"seq_1k": chat(1024), "seq_near": chat(NEAR_TOKENS), "seq_4k": chat(4096)}


def config_for(window: int, bound: bool) -> dict[str, Any]:
    """config/local.yaml with llama-3-8b's window and the option set."""
    config = copy.deepcopy(SHIPPED())
    config["models"]["llama-3-8b"]["context_window"] = window
    config.setdefault("admission", {})["bound_admission"] = bound
    return config


def pin(pid: int, cpus: set[int]) -> None:
    """Every thread of process `pid` onto `cpus` (a thread started later inherits its creator's set)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except OSError:  # a thread that ended meanwhile
            continue


def pin_processor(stack: Stack) -> None:
    """The processor alone on the last CPU; everything else of the run, this process included, on the rest."""
    cpus = CPUS
    if len(cpus) < 2:
        raise SystemExit("--pin needs at least two CPUs")
    own, rest = {cpus[-1]}, set(cpus[:-1])
    pin(os.getpid(), rest)
    for name, process in stack.processes.items():
        pin(process.popen.pid, own if name == "processor" else rest)


def run_stack(
    name: str,
    variant: Variant,
    knobs: dict[str, Any] | None,
    phases: tuple[str, ...],
    n: int,
    pinned: bool = False,
    pause_s: float = 0.0,
) -> dict[str, Any]:
    original = profiles.shipped
    if knobs is not None:
        profiles.shipped = lambda: config_for(knobs["window"], knobs["bound"])
    try:
        stack = Stack(variant).start()
    finally:
        profiles.shipped = original
    if pinned:
        pin_processor(stack)
    out: dict[str, Any] = {"stack": name}
    try:
        for phase in phases:
            before = sidecar_timings(stack)
            row = measured(stack, BODIES[phase], 1, n, pause_s)
            row.pop("ends")
            after = sidecar_timings(stack)
            line = f"bound: {name} {phase}: p50 {row['p50_ms']:.2f} ms errors {row['errors']}"
            if after:  # the sidecar's own decision time, mean over the phase
                count = max(1.0, after["decision_count"] - before["decision_count"])
                row["decision_mean_us"] = (after["decision_sum"] - before["decision_sum"]) / count * 1e6
                line += f", decision mean {row['decision_mean_us']:.0f} µs"
            out[phase] = row
            print(line, flush=True)
    finally:
        stack.stop()
    return out


def added(run: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Added p50 ms over plain Envoy per stack and phase, and the ratio to the no-op's."""
    by = {row["stack"]: row for row in run}
    out: dict[str, dict[str, float]] = {}
    for name, row in by.items():
        for phase in BODIES:
            if phase not in row:
                continue
            extra = row[phase]["p50_ms"] - by["envoy"][phase]["p50_ms"]
            noop = by["noop-lean"][phase]["p50_ms"] - by["envoy"][phase]["p50_ms"]
            out.setdefault(name, {})[f"{phase}_added_ms"] = extra
            out[name][f"{phase}_vs_noop"] = extra / noop if noop > 0 else float("nan")
    return out


async def _decisions(raw: bytes, window: int, bound: bool, n: int) -> list[float]:
    """Time to the admission verdict inside one process (no gRPC, no Envoy): parse, bound or count, plan,
    limiter, KV budget; the exact count of a bound admission runs after the clock stops."""
    clock = FakeClock()  # a second per request: the shipped buckets refill, nothing is refused
    config = parse_config(config_for(window, bound))
    sidecar = Sidecar(config=config, store=LocalStore(clock), metrics=Metrics(), clock=clock)
    await sidecar.apply_config(config)
    head = RequestHead("POST", "/v1/chat/completions", {})
    times: list[float] = []
    for i in range(n + 20):
        clock.advance(1.0)
        exchange = Exchange(sidecar.admission)
        exchange.request_headers(head)
        t0 = time.perf_counter()
        steps = exchange.request_body(raw)
        verdict = await steps.__anext__()
        elapsed = time.perf_counter() - t0
        assert isinstance(verdict, Forward), verdict
        async for _ in steps:
            pass
        exchange.close()
        await sidecar.admission.drain()
        if i >= 20:  # warm-up
            times.append(elapsed * 1e6)
    return times


def decisions(n: int) -> dict[str, dict[str, float]]:
    """p50 / p90 µs to the verdict, bound admission on and off, for 1k tokens in 8k and 4k in 32k."""
    out: dict[str, dict[str, float]] = {}
    for label, body, window in (("1k-8k", BODIES["seq_1k"], 8192), ("4k-32k", BODIES["seq_4k"], 32768)):
        for bound in (True, False):
            times = asyncio.run(_decisions(body, window, bound, n))
            key = f"{label}-{'on' if bound else 'off'}"
            out[key] = {"p50_us": percentile(times, 50), "p90_us": percentile(times, 90)}
            print(f"bound: decision {key}: {out[key]}", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--off-first", action="store_true", help="each off stack before its on stack")
    parser.add_argument("--decisions-only", action="store_true", help="in-process time to the verdict")
    parser.add_argument("--pin", action="store_true", help="the processor on a CPU of its own (docstring)")
    parser.add_argument("--pause-ms", type=float, default=0.0, help="client pause between requests")
    args = parser.parse_args()
    if args.decisions_only:
        write_json("overhead-bound-decisions.json", decisions(1000))
        return
    t0 = time.monotonic()
    stacks = list(STACKS)
    if args.off_first:  # the order of the stacks within a run, to rule it out
        stacks[2:4], stacks[4:6] = stacks[3:1:-1], stacks[5:3:-1]
    runs = [
        [
            run_stack(*stack, n=args.requests, pinned=args.pin, pause_s=args.pause_ms / 1000)
            for stack in stacks
        ]
        for _ in range(args.repeat)
    ]
    figures = [added(run) for run in runs]
    result = {"runs": runs, "figures": figures, "duration_s": time.monotonic() - t0, "pinned": args.pin}
    result["pause_ms"] = args.pause_ms
    write_json("overhead-bound-pinned.json" if args.pin else "overhead-bound.json", result)
    for name in figures[0]:
        keys = figures[0][name]
        line = ", ".join(
            f"{k} {statistics.median(f[name][k] for f in figures):.2f}" for k in keys if not k.startswith("_")
        )
        print(f"bound: {name}: {line}")


if __name__ == "__main__":
    main()
