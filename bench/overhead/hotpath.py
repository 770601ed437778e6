"""Where one admission's CPU goes: `python -m bench.overhead.hotpath [--profile lean|inline]
[--config shipped|admit-all] [--processor sidecar|noop] [--requests N] [--tokens N] [--clients N]
[--pyspy FILE]`.

One stack of `profiles.py` (the no-op upstream, Envoy, the sidecar or the no-op processor), four clients in
a closed loop of chat requests (1k-token prompts unless told), and the processor's CPU per request from its
threads' scheduler run time (nanoseconds, `/proc/<pid>/task/*/schedstat`), the answers' p50, and the
sidecar's mean decision and prompt-count times from its own histograms (`extproc_decision_seconds`,
`extproc_tokenize_seconds`): with `--clients 1` they split the latency the sidecar adds.
With `--pyspy FILE` py-spy (`pip install py-spy`) samples the processor meanwhile (`--nonblocking`, so the
sampled process is never paused) and the functions with the most samples, by their own time, by file and
with their callees, are printed; the collapsed stacks go to FILE for a flame graph. py-spy's sampling runs on
the same cores: compare CPU per request only between runs without it.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import re
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

from bench.common import percentile, write_json
from bench.overhead.lagprobe import UVLOOP_ENV
from bench.overhead.lua import cpu_ns
from bench.overhead.profiles import CLIENTS, Stack, Variant, chat, closed_loop

SERIES = (
    ("decision", 'extproc_decision_seconds_{}{{outcome="admitted"}}'),
    ("tokenize", "extproc_tokenize_seconds_{}"),
)
"""The sidecar's own timings: body received to admission decision, and the prompt count inside it."""


def sidecar_timings(stack: Stack) -> dict[str, float]:
    """Sum and count of the sidecar's decision and tokenize histograms (empty for the no-op processor)."""
    if stack.path.processor != "sidecar":
        return {}
    with urllib.request.urlopen(f"http://127.0.0.1:{stack.ports.admin}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    out: dict[str, float] = {}
    for name, series in SERIES:
        for part in ("sum", "count"):
            found = re.search(rf"^{re.escape(series.format(part))} (\S+)$", text, re.M)
            out[f"{name}_{part}"] = float(found.group(1)) if found else 0.0
    return out


def measure(stack: Stack, body: bytes, requests: int, clients: int) -> dict[str, Any]:
    pids = {name: proc.popen.pid for name, proc in stack.processes.items()}
    before = {name: cpu_ns(pid) for name, pid in pids.items()}
    timings = sidecar_timings(stack)
    t0 = time.monotonic()
    results = asyncio.run(closed_loop(stack.url, body, clients, requests))
    wall = time.monotonic() - t0
    used = {name: cpu_ns(pid) - before[name] for name, pid in pids.items()}
    after = sidecar_timings(stack)
    latencies = [r[0] * 1000 for r in results if r is not None]
    row: dict[str, Any] = {
        "requests": requests,
        "errors": sum(r is None for r in results),
        "wall_s": wall,
        "p50_ms": percentile(latencies, 50),
        "cpu_us_per_request": {name: ns / 1000 / requests for name, ns in used.items()},
    }
    for name, _ in SERIES:
        count = after.get(f"{name}_count", 0.0) - timings.get(f"{name}_count", 0.0)
        if count:
            row[f"{name}_mean_ms"] = (after[f"{name}_sum"] - timings[f"{name}_sum"]) / count * 1000
    return row


def top(collapsed: Path, n: int = 25) -> str:
    """The functions with the most samples: by own time (the leaf frame) and with callees (any frame)."""
    own: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    by_file: collections.Counter[str] = collections.Counter()
    total = 0
    for line in collapsed.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        samples = int(count)
        total += samples
        frames = stack.split(";")
        own[frames[-1]] += samples
        by_file[_file(frames[-1])] += samples
        for frame in set(frames):
            inclusive[frame] += samples
    lines = [f"{total} samples", "own time:"]
    lines += [f"  {100 * c / total:5.1f}%  {f}" for f, c in own.most_common(n)]
    lines.append("own time by file:")
    lines += [f"  {100 * c / total:5.1f}%  {f}" for f, c in by_file.most_common(n)]
    lines.append("with callees:")
    lines += [f"  {100 * c / total:5.1f}%  {f}" for f, c in inclusive.most_common(n)]
    return "\n".join(lines)


def _file(frame: str) -> str:
    """`function (path/to/file.py:line)` -> `path/to/file.py` (site-packages paths shortened)."""
    path = frame.rpartition(" (")[2].rpartition(":")[0]
    return path.rpartition("site-packages/")[2]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--profile", default="lean", choices=("lean", "inline"))
    parser.add_argument("--config", default="shipped", choices=("shipped", "admit-all"))
    parser.add_argument("--processor", default="sidecar", choices=("sidecar", "noop"))
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--clients", type=int, default=CLIENTS)
    parser.add_argument("--repeat", type=int, default=1, help="measured phases, one after another")
    parser.add_argument("--pyspy", type=Path, default=None, help="collapsed py-spy stacks to this file")
    parser.add_argument("--uvloop", action="store_true", help="the sidecar on uvloop's event loop")
    args = parser.parse_args()
    if args.uvloop:
        os.environ[UVLOOP_ENV] = "1"  # read by bench/overhead/lagprobe.py, which runs the sidecar
    variant = Variant(args.processor, args.profile, args.config if args.processor == "sidecar" else "")
    body = chat(args.tokens)
    stack = Stack(variant).start()
    spy = None
    try:
        measure(stack, body, 100, args.clients)  # warm-up
        if args.pyspy is not None:
            pid = stack.processes["processor"].popen.pid
            argv = ["py-spy", "record", "--nonblocking", "--format", "raw", "--rate", "200"]
            argv += ["--pid", str(pid), "--output", str(args.pyspy)]
            spy = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(1.0)
        rows = [measure(stack, body, args.requests, args.clients) for _ in range(args.repeat)]
    finally:
        if spy is not None:
            spy.send_signal(2)  # SIGINT: py-spy writes its file and exits
            spy.wait(60)
        stack.stop()
    for row in rows:
        cpu = {k: round(v) for k, v in row["cpu_us_per_request"].items()}
        timings = {k: round(v, 2) for k, v in row.items() if k.endswith("_mean_ms")}
        loop = " (uvloop)" if args.uvloop else ""
        print(
            f"hotpath: {variant.name}{loop} {args.tokens} tokens, {args.clients} clients: "
            f"errors {row['errors']} p50 {row['p50_ms']:.2f} ms {timings} cpu µs/request {cpu}"
        )
    name = f"hotpath-{variant.name}{'-uvloop' if args.uvloop else ''}-{args.tokens}-c{args.clients}.json"
    write_json(name, {"variant": variant.name, "tokens": args.tokens, "clients": args.clients, "rows": rows})
    if args.pyspy is not None and args.pyspy.is_file():
        print(top(args.pyspy))


if __name__ == "__main__":
    main()
