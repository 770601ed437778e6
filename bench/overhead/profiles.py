"""What each profile costs, shipped config and admit-everything: `python -m bench.overhead.profiles`.

Seven stacks, one after another, each with the no-op upstream of `upstream.py` and Envoy 1.40
(`--concurrency 1`): plain Envoy (envoy/envoy.yaml without ext_proc), the no-op processor in each profile
(inline: envoy/envoy.yaml; lean: the rendered lean config, the no-op answering with the sidecar's metadata so
that Envoy's Lua reader and access log do the same work), and the sidecar in each profile with two configs:

* `admit-all`: no limits, no feedback (what `main.py` measures: parsing, counting, the limiter, settlement);
* `shipped`: config/local.yaml as `make run` runs it (llama-3-8b limits, KV feedback through a real exporter
  scraping the upstream's vLLM metrics page, KV budget on), ports rewritten.

Phases per stack (requests are 1k- or 4k-token chat prompts for llama-3-8b; streams are 100 SSE chunks 2 ms
apart, `max_tokens` 16):

* `seq_1k`, `seq_4k`: one client, sequential, keep-alive: latency (the added latency over plain Envoy is the
  number the 1.3x target compares);
* `conc_1k`: four clients in a closed loop: CPU per request of the processor and of Envoy;
* `streams_short`, `streams`: four clients in a closed loop of streamed answers of 10 and of 100 chunks: CPU
  per chunk = (CPU per 100-chunk stream - CPU per 10-chunk stream) / 90, so that a stream's fixed costs
  (the usage option, a larger end report, an open stream's idle wake-ups) are not counted per chunk;
* `release`: sequential streams; the client notes the wall time of each answer's last byte, the sidecar
  (run under bench/overhead/lagprobe.py --releases) the wall time of each settlement: their difference is
  the end-of-stream to slot-release delay.

CPU is utime + stime of each process from /proc over the phase (bench/common.py). The machine is shared:
compare ratios within one run, and repeat (`--repeat`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import signal
import statistics
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from bench.common import percentile, validate_envoy_config, write_json
from bench.overhead.main import STREAM_CHUNKS, StackProcesses, _wait_port, prompt_text
from devstack.envoy import remove_ext_proc, render_envoy_config
from devstack.processes import Ports, Process, envoy_command, exporter_command, wait_http
from devstack.stack import LOCAL_CONFIG, sidecar_config_with_ports
from extproc.config import parse_config

MODEL = "llama-3-8b"
SHORT_STREAM = 10
"""Chunks of the short streams: CPU per chunk is the slope between them and the 100-chunk ones, so what a
stream costs once (opening, the usage option, a larger end report) is not charged to its chunks."""
CHUNK_GAP_MS = 2.0
CLIENTS = 4


def chat(tokens: int, chunks: int = 0) -> bytes:
    """A chat request; `chunks` > 0 streams that many SSE chunks back (the upstream reads `x_chunks`)."""
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": prompt_text(tokens)}],
        "max_tokens": 16,
    }
    if chunks:
        body |= {"stream": True, "x_chunks": chunks}
    return json.dumps(body).encode()


def admit_all() -> dict[str, Any]:
    return {
        "admission": {"max_body_bytes": 1 << 20},
        "models": {"*": {"context_window": 40000, "default_max_tokens": 16}},
        "log_level": "warning",
    }


def shipped() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load(LOCAL_CONFIG.read_text())
    return loaded


@dataclass(frozen=True)
class Variant:
    """One stack: `processor` is none (plain Envoy), noop or sidecar."""

    processor: str
    profile: str = "inline"
    config: str = ""

    @property
    def name(self) -> str:
        if self.processor == "none":
            return "envoy"
        return "-".join(p for p in (self.processor, self.profile, self.config) if p)


PATHS = (
    Variant("none"),
    Variant("noop", "inline"),
    Variant("noop", "lean"),
    Variant("sidecar", "inline", "admit-all"),
    Variant("sidecar", "lean", "admit-all"),
    Variant("sidecar", "inline", "shipped"),
    Variant("sidecar", "lean", "shipped"),
)


@dataclass
class Stack(StackProcesses):
    STOP_ORDER = ("envoy", "processor", "exporter", "upstream")
    path: Variant
    ports: Ports = field(default_factory=Ports.free)
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="bench-profiles-")))
    processes: dict[str, Process] = field(default_factory=dict)

    @property
    def releases_file(self) -> Path:
        return self.workdir / "releases.json"

    def _start(self) -> None:
        py = sys.executable
        ports = self.ports
        up = Process.start(
            "upstream",
            [py, "-m", "bench.overhead.upstream", "--port", str(ports.upstream), *self._stream_args()],
            self.workdir,
        )
        self.processes["upstream"] = up
        path = self.path
        sidecar = None
        if path.processor == "noop":
            argv = [py, "-m", "bench.overhead.noop_processor", "--port", str(ports.grpc)]
            argv += ["--lean"] if path.profile == "lean" else []
            self.processes["processor"] = Process.start("processor", argv, self.workdir)
        elif path.processor == "sidecar":
            raw = shipped() if path.config == "shipped" else admit_all()
            exporter = path.config == "shipped"
            if exporter:
                self._start_exporter()
            config = sidecar_config_with_ports(raw, ports, with_exporter=exporter)
            sidecar = parse_config(config)
            config_path = self.workdir / "sidecar.yaml"
            config_path.write_text(yaml.safe_dump(config))
            argv = [py, "-m", "bench.overhead.lagprobe", "--config", str(config_path)]
            argv += ["--releases", str(self.releases_file)]
            self.processes["processor"] = Process.start("processor", argv, self.workdir)
        envoy = render_envoy_config(ports, profile=path.profile, sidecar=sidecar)
        if path.processor == "none":
            remove_ext_proc(envoy)
        envoy_path = self.workdir / "envoy.yaml"
        envoy_path.write_text(yaml.safe_dump(envoy))
        validate_envoy_config(envoy_path)
        self.processes["envoy"] = Process.start(
            "envoy", envoy_command(envoy_path, ports.envoy_admin), self.workdir
        )
        wait_http(f"http://127.0.0.1:{ports.upstream}/metrics", proc=up)
        if path.processor == "sidecar":
            wait_http(f"http://127.0.0.1:{ports.admin}/readyz", proc=self.processes["processor"])
        elif path.processor == "noop":
            _wait_port(ports.grpc, self.processes["processor"])
        wait_http(f"http://127.0.0.1:{ports.envoy_admin}/ready", proc=self.processes["envoy"])
        if path.config == "shipped":
            self._wait_fresh_feed()

    @staticmethod
    def _stream_args() -> list[str]:
        return ["--chunks", str(STREAM_CHUNKS), "--chunk-gap-ms", str(CHUNK_GAP_MS)]

    def _start_exporter(self) -> None:
        upstream = f"http://127.0.0.1:{self.ports.upstream}"
        command = exporter_command(self.ports, "bench", upstream, MODEL)
        self.processes["exporter"] = Process.start("exporter", command, self.workdir)

    def _wait_fresh_feed(self) -> None:
        """Full limits before measuring: the feed is fresh and the adaptive scale back at 1.0."""
        deadline = time.monotonic() + 30
        url = f"http://127.0.0.1:{self.ports.admin}/metrics"
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=2) as reply:
                text = reply.read().decode()
                if f'extproc_adaptive_scale_ratio{{pool="{MODEL}"}} 1.0' in text:
                    return
            time.sleep(0.2)
        raise TimeoutError("the shipped config's KV feed never became fresh")


# -- load ---------------------------------------------------------------------------------------------------


async def one(session: aiohttp.ClientSession, url: str, body: bytes) -> tuple[float, float] | None:
    """(latency s, wall time of the last byte), or None when the answer was not a 200."""
    started = time.monotonic()
    async with session.post(url, data=body, headers={"content-type": "application/json"}) as resp:
        async for _chunk in resp.content.iter_any():
            pass
        ended = time.time()
        if resp.status != 200:
            return None
    return time.monotonic() - started, ended


async def closed_loop(
    url: str, body: bytes, clients: int, total: int, pause_s: float = 0.0
) -> list[tuple[float, float] | None]:
    """`total` requests from `clients` clients; each sends its next request `pause_s` after its answer."""
    endpoint = f"{url}/v1/chat/completions"
    results: list[tuple[float, float] | None] = []
    remaining = total

    async def client(session: aiohttp.ClientSession) -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            results.append(await one(session, endpoint, body))
            if pause_s:
                await asyncio.sleep(pause_s)

    connector = aiohttp.TCPConnector(limit=clients)
    async with aiohttp.ClientSession(connector=connector) as session:
        for _ in range(3):  # warm the connections and the sidecar's caches
            await one(session, endpoint, body)
        await asyncio.gather(*(client(session) for _ in range(clients)))
    return results


def measured(stack: Stack, body: bytes, clients: int, total: int, pause_s: float = 0.0) -> dict[str, Any]:
    before = stack.cpu()
    t0 = time.monotonic()
    results = asyncio.run(closed_loop(stack.url, body, clients, total, pause_s))
    wall = time.monotonic() - t0
    after = stack.cpu()
    cpu = {k: after[k] - before.get(k, 0.0) for k in after}
    ok = [r for r in results if r is not None]
    latencies = [r[0] * 1000 for r in ok]
    return {
        "n": len(results),
        "errors": len(results) - len(ok),
        "p50_ms": percentile(latencies, 50),
        "p99_ms": percentile(latencies, 99),
        "wall_s": wall,
        "cpu_s": cpu,
        "cpu_us_per_request": {k: v / max(1, len(results)) * 1e6 for k, v in cpu.items()},
        "ends": [r[1] for r in ok],
    }


def _rounded(values: dict[str, float]) -> dict[str, int]:
    return {k: round(v) for k, v in values.items()}


def release_delays(stack: Stack, ends: list[float], since: float) -> list[float]:
    """ms from each answer's last byte at the client to its lease's settlement (sequential streams)."""
    stack.processes["processor"].popen.send_signal(signal.SIGTERM)
    stack.processes["processor"].popen.wait(30)
    releases = [t for t in json.loads(stack.releases_file.read_text()) if t >= since]
    # The phase's warm-up requests settled first: the last len(ends) settlements are the measured streams.
    releases = releases[-len(ends) :]
    return [(r - e) * 1000 for e, r in zip(ends, releases, strict=True)]


def run_path(path: Variant, short: bool) -> dict[str, Any]:
    n_seq, n_conc, n_streams, n_release = (60, 200, 12, 12) if short else (300, 1000, 60, 100)
    stack = Stack(path).start()
    out: dict[str, Any] = {"path": path.name, "processor": path.processor, "profile": path.profile}
    out["config"] = path.config
    try:
        for name, body, clients, total in (
            ("seq_1k", chat(1024), 1, n_seq),
            ("seq_4k", chat(4096), 1, n_seq),
            ("conc_1k", chat(1024), CLIENTS, n_conc),
            ("streams_short", chat(1024, chunks=SHORT_STREAM), CLIENTS, n_streams),
            ("streams", chat(1024, chunks=STREAM_CHUNKS), CLIENTS, n_streams),
        ):
            row = measured(stack, body, clients, total)
            row.pop("ends")
            out[name] = row
            print(
                f"profiles: {path.name} {name}: p50 {row['p50_ms']:.2f} ms p99 {row['p99_ms']:.2f} ms "
                f"errors {row['errors']} cpu us/req {_rounded(row['cpu_us_per_request'])}",
                flush=True,
            )
        if path.processor == "sidecar":
            since = time.time()
            row = measured(stack, chat(1024, chunks=STREAM_CHUNKS), 1, n_release)
            delays = release_delays(stack, row.pop("ends"), since)
            out["release"] = {
                "n": len(delays),
                "p50_ms": percentile(delays, 50),
                "p99_ms": percentile(delays, 99),
                "max_ms": max(delays) if delays else None,
            }
            print(f"profiles: {path.name} release: {out['release']}", flush=True)
    finally:
        stack.stop()
    return out


def run(short: bool, repeat: int = 1) -> dict[str, Any]:
    t0 = time.monotonic()
    paths = [p for p in PATHS if p.config != "admit-all"] if short else PATHS  # make bench: < 5 minutes
    runs = [[run_path(path, short) for path in paths] for _ in range(repeat)]
    result = {
        "short": short,
        "clients": CLIENTS,
        "stream_chunks": STREAM_CHUNKS,
        "chunk_gap_ms": CHUNK_GAP_MS,
        "runs": runs,
        "duration_s": time.monotonic() - t0,
    }
    write_json(f"overhead-profiles{'-short' if short else ''}.json", result)
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--short", action="store_true")
    parser.add_argument("--repeat", type=int, default=1)
    args = parser.parse_args()
    run(args.short, args.repeat)


# -- tables (python -m bench.report) ------------------------------------------------------------------------


def _per_chunk(row: dict[str, Any], process: str, chunks: int) -> float:
    """CPU µs per chunk of one process: the slope between the short and the long streams."""
    long = row["streams"]["cpu_us_per_request"].get(process, math.nan)
    short = row["streams_short"]["cpu_us_per_request"].get(process, math.nan)
    return float((long - short) / (chunks - SHORT_STREAM))


def figures(run: list[dict[str, Any]], chunks: int) -> dict[str, dict[str, float]]:
    """The targets' figures of one run, per path."""
    by_name = {row["path"]: row for row in run}
    envoy = by_name["envoy"]
    envoy_chunk = _per_chunk(envoy, "envoy", chunks)
    out: dict[str, dict[str, float]] = {}
    for row in run:
        noop = by_name.get(f"noop-{row['profile']}")
        added_4k = row["seq_4k"]["p50_ms"] - envoy["seq_4k"]["p50_ms"]
        noop_4k = noop["seq_4k"]["p50_ms"] - envoy["seq_4k"]["p50_ms"] if noop else math.nan
        proc_chunk = _per_chunk(row, "processor", chunks) if row["processor"] != "none" else math.nan
        envoy_extra = _per_chunk(row, "envoy", chunks) - envoy_chunk
        out[row["path"]] = {
            "added_1k_ms": row["seq_1k"]["p50_ms"] - envoy["seq_1k"]["p50_ms"],
            "added_4k_ms": added_4k,
            "vs_noop_4k": added_4k / noop_4k if noop_4k > 0 else math.nan,
            "proc_us_req": row["conc_1k"]["cpu_us_per_request"].get("processor", math.nan),
            "envoy_us_req": row["conc_1k"]["cpu_us_per_request"]["envoy"],
            "proc_us_chunk": proc_chunk,
            "envoy_extra_us_chunk": envoy_extra,
            "extra_us_chunk": (proc_chunk if proc_chunk == proc_chunk else 0.0) + envoy_extra,
            "release_p50_ms": row.get("release", {}).get("p50_ms", math.nan),
            "release_p99_ms": row.get("release", {}).get("p99_ms", math.nan),
        }
    return out


def _spread(values: list[float], digits: int) -> str:
    values = [v for v in values if v == v]
    if not values:
        return "-"
    middle = statistics.median(values)
    if len(values) == 1:
        return f"{middle:.{digits}f}"
    return f"{middle:.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


COLUMNS = (
    ("added_1k_ms", "added p50 ms, 1k", 2),
    ("added_4k_ms", "added p50 ms, 4k", 2),
    ("vs_noop_4k", "4k added / no-op's", 2),
    ("proc_us_req", "processor µs/req (4 clients)", 0),
    ("envoy_us_req", "Envoy µs/req", 0),
    ("proc_us_chunk", "processor µs/chunk", 1),
    ("envoy_extra_us_chunk", "Envoy extra µs/chunk", 1),
    ("extra_us_chunk", "processor + Envoy extra µs/chunk", 1),
    ("release_p50_ms", "end → release p50 ms", 1),
    ("release_p99_ms", "end → release p99 ms", 1),
)


def tables(data: dict[str, Any]) -> str:
    """One row per path: the median over the runs, (min-max) when repeated."""
    from bench.common import md_table

    per_run = [figures(run, data["stream_chunks"]) for run in data["runs"]]
    rows = []
    for path in [row["path"] for row in data["runs"][0]]:
        rows.append([path, *(_spread([f[path][key] for f in per_run], d) for key, _, d in COLUMNS)])
    note = f"{len(per_run)} run(s); median (min-max) across runs.\n\n"
    return note + md_table(["path", *(title for _, title, _ in COLUMNS)], rows)
