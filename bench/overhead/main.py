"""What the sidecar costs: Envoy alone vs Envoy + a no-op Python ext_proc processor vs Envoy + the sidecar.

One load generator (this process, asyncio + aiohttp), one no-op upstream (`upstream.py`), the same Envoy
config (envoy/envoy.yaml, ports rewritten; without the ext_proc filter for the baseline). Open-loop runs
schedule every send on a fixed clock and measure latency from the scheduled time, so a slow response
delays no later send (no coordinated omission). CPU comes from /proc/<pid>/stat of each process.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

import aiohttp
import yaml

from bench.common import percentile, proc_cpu_seconds, validate_envoy_config, write_json
from devstack.envoy import remove_ext_proc, render_envoy_config
from devstack.processes import Ports, Process, envoy_command, wait_http
from extproc.sim.textgen import vocabulary

MODEL = "bench-model"
STREAM_CHUNKS = 100
CHUNK_GAP_MS = 2.0


def prompt_text(tokens: int) -> str:
    """English-like words, each one cl100k token: a chat prompt of exactly `tokens` content tokens."""
    words = vocabulary()
    return "".join(words[i % len(words)] for i in range(tokens))


def chat_body(tokens: int, stream: bool = False, content: str | None = None) -> bytes:
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": content if content is not None else prompt_text(tokens)}],
        "max_tokens": 16,
    }
    if stream:
        body["stream"] = True
    return json.dumps(body).encode()


def sidecar_config() -> dict[str, Any]:
    """Admits everything (no limits): the cost measured is parsing, counting, the limiter and settlement."""
    return {
        "admission": {"max_body_bytes": 1 << 20},
        "models": {"*": {"context_window": 40000, "default_max_tokens": 16}},
        "log_level": "warning",
    }


def _wait_port(port: int, proc: Process, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.popen.poll() is not None:
            raise RuntimeError(f"{proc.name} exited; log: {proc.log_path}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
            return
        time.sleep(0.05)
    raise TimeoutError(f"port {port} not open after {timeout_s}s")


class StackProcesses:
    """What the benchmark stacks share: their processes by name, started all or none, stopped in
    `STOP_ORDER` (Envoy first, so nothing sends to a stopped process), and their CPU use from /proc."""

    STOP_ORDER: tuple[str, ...] = ("envoy", "processor", "upstream")
    ports: Ports
    processes: dict[str, Process]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.ports.envoy}"

    def start(self) -> Self:
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        for name in self.STOP_ORDER:
            proc = self.processes.pop(name, None)
            if proc is not None:
                proc.stop()

    def cpu(self) -> dict[str, float]:
        out = {}
        for name, proc in self.processes.items():
            with contextlib.suppress(OSError):
                out[name] = proc_cpu_seconds(proc.popen.pid)
        return out


@dataclass
class Stack(StackProcesses):
    """upstream + (nothing | no-op processor | sidecar) + Envoy. `body_mode`: STREAMED, NONE or OBSERVABILITY
    (the response body mode; observability_mode makes Envoy send without waiting for answers)."""

    mode: str
    body_mode: str = "STREAMED"
    lag_probe: Path | None = None  # sidecar only: run it under bench.overhead.lagprobe, samples to this file
    ports: Ports = field(default_factory=Ports.free)
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="bench-overhead-")))
    processes: dict[str, Process] = field(default_factory=dict)

    def pid(self, name: str) -> int | None:
        proc = self.processes.get(name)
        return proc.popen.pid if proc else None

    def _start(self) -> None:
        py = sys.executable
        up = Process.start(
            "upstream",
            [
                py,
                "-m",
                "bench.overhead.upstream",
                "--port",
                str(self.ports.upstream),
                "--chunks",
                str(STREAM_CHUNKS),
                "--chunk-gap-ms",
                str(CHUNK_GAP_MS),
            ],
            self.workdir,
        )
        self.processes["upstream"] = up
        if self.mode == "noop":
            self.processes["processor"] = Process.start(
                "processor",
                [py, "-m", "bench.overhead.noop_processor", "--port", str(self.ports.grpc)],
                self.workdir,
            )
        elif self.mode == "sidecar":
            cfg = {**sidecar_config(), "server": {"grpc_listen": f"127.0.0.1:{self.ports.grpc}"}}
            cfg["server"]["admin_listen"] = f"127.0.0.1:{self.ports.admin}"
            path = self.workdir / "sidecar.yaml"
            path.write_text(yaml.safe_dump(cfg))
            argv = [py, "-m", "extproc", "serve", "--config", str(path)]
            if self.lag_probe is not None:
                argv = [
                    py,
                    "-m",
                    "bench.overhead.lagprobe",
                    "--config",
                    str(path),
                    "--out",
                    str(self.lag_probe),
                ]
            self.processes["processor"] = Process.start("processor", argv, self.workdir)
        envoy_cfg = render_envoy_config(self.ports)
        if self.mode == "envoy":
            remove_ext_proc(envoy_cfg)
        else:
            for f in envoy_cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"]:
                for hf in f["typed_config"]["http_filters"]:
                    if hf["name"] == "envoy.filters.http.ext_proc":
                        tc = hf["typed_config"]
                        if self.body_mode == "NONE":
                            tc["processing_mode"]["response_body_mode"] = "NONE"
                        elif self.body_mode == "OBSERVABILITY":
                            tc["observability_mode"] = True
        envoy_path = self.workdir / f"envoy-{self.mode}-{self.body_mode}.yaml"
        envoy_path.write_text(yaml.safe_dump(envoy_cfg))
        validate_envoy_config(envoy_path)
        self.processes["envoy"] = Process.start(
            "envoy", envoy_command(envoy_path, self.ports.envoy_admin), self.workdir
        )
        wait_http(f"http://127.0.0.1:{self.ports.upstream}/", proc=up)
        if self.mode == "sidecar":
            wait_http(f"http://127.0.0.1:{self.ports.admin}/readyz", proc=self.processes["processor"])
        elif self.mode == "noop":
            _wait_port(self.ports.grpc, self.processes["processor"])
        wait_http(f"http://127.0.0.1:{self.ports.envoy_admin}/ready", proc=self.processes["envoy"])


# -- load ---------------------------------------------------------------------------------------------------


@dataclass
class Sample:
    latency: float | None  # seconds from the scheduled send to the last byte; None = failed
    gaps: list[float] = field(default_factory=list)  # inter-chunk gaps of a streamed answer


async def _request(
    session: aiohttp.ClientSession, url: str, body: bytes, t_sched: float, stream: bool
) -> Sample:
    try:
        async with session.post(url, data=body, headers={"content-type": "application/json"}) as resp:
            if not stream:
                await resp.read()
                return Sample(time.monotonic() - t_sched if resp.status == 200 else None)
            gaps: list[float] = []
            last = None
            async for _chunk in resp.content.iter_any():
                now = time.monotonic()
                if last is not None:
                    gaps.append(now - last)
                last = now
            return Sample(time.monotonic() - t_sched if resp.status == 200 else None, gaps)
    except (aiohttp.ClientError, TimeoutError):
        return Sample(None)


async def sequential(url: str, body: bytes, n: int, stream: bool = False) -> list[Sample]:
    out = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as session:
        for _ in range(min(3, n)):  # warm the connection and the sidecar's caches
            await _request(session, f"{url}/v1/chat/completions", body, time.monotonic(), stream)
        for _ in range(n):
            out.append(await _request(session, f"{url}/v1/chat/completions", body, time.monotonic(), stream))
    return out


async def open_loop(
    url: str,
    body: bytes,
    rate: float,
    duration_s: float,
    stream: bool = False,
    extra: bytes | None = None,
    extra_rate: float = 0.0,
) -> tuple[list[Sample], list[Sample]]:
    """`rate` sends per second of `body` for `duration_s` (plus `extra` bodies at `extra_rate`, separately
    recorded), each latency measured from its scheduled time; stragglers are cut 10 s after the last send."""
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
        endpoint = f"{url}/v1/chat/completions"
        start = time.monotonic() + 0.2
        schedule = [(start + i / rate, body, False) for i in range(int(rate * duration_s))]
        if extra is not None and extra_rate > 0:
            schedule += [
                (start + 0.05 + i / extra_rate, extra, True) for i in range(int(extra_rate * duration_s))
            ]
        schedule.sort(key=lambda s: s[0])
        tasks: list[tuple[bool, asyncio.Task[Sample]]] = []
        for t_sched, b, is_extra in schedule:
            delay = t_sched - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append((is_extra, asyncio.create_task(_request(session, endpoint, b, t_sched, stream))))
        done, pending = await asyncio.wait([t for _, t in tasks], timeout=10)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        main = [t.result() if t in done else Sample(None) for e, t in tasks if not e]
        extras = [t.result() if t in done else Sample(None) for e, t in tasks if e]
        return main, extras


def stats(samples: list[Sample]) -> dict[str, Any]:
    lat = [s.latency * 1000 for s in samples if s.latency is not None]
    gaps = [g * 1000 for s in samples for g in s.gaps]
    out: dict[str, Any] = {
        "n": len(samples),
        "errors": sum(1 for s in samples if s.latency is None),
        "p50_ms": percentile(lat, 50),
        "p99_ms": percentile(lat, 99),
        "mean_ms": sum(lat) / len(lat) if lat else None,
    }
    if gaps:
        out["chunk_gap_p50_ms"] = percentile(gaps, 50)
        out["chunk_gap_p99_ms"] = percentile(gaps, 99)
    return out


def measured(stack: Stack, coro: Any) -> tuple[Any, dict[str, float], float]:
    """Run one load coroutine; CPU seconds each process spent during it, and wall seconds."""
    before = stack.cpu()
    t0 = time.monotonic()
    result = asyncio.run(coro)
    wall = time.monotonic() - t0
    after = stack.cpu()
    return result, {k: after[k] - before.get(k, 0.0) for k in after}, wall


# -- the scenarios ------------------------------------------------------------------------------------------

SIZES = (1024, 4096, 32768)
FIXED_RATE = {1024: 100.0, 4096: 100.0, 32768: 25.0}
LADDER = (100.0, 200.0, 300.0, 400.0, 600.0, 800.0)


def run_mode(mode: str, short: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"mode": mode}
    n_seq = 100 if short else 400
    duration = 3.0 if short else 6.0
    stack = Stack(mode).start()
    try:
        sizes = SIZES[:2] if short else SIZES
        for size in sizes:
            body = chat_body(size)
            seq, cpu, _ = measured(stack, sequential(stack.url, body, n_seq))
            row: dict[str, Any] = {"sequential": stats(seq), "sequential_cpu_s": cpu, "sequential_n": n_seq}
            rate = FIXED_RATE[size]
            (res, _), cpu, wall = measured(stack, open_loop(stack.url, body, rate, duration))
            row["open_loop"] = {**stats(res), "rate": rate, "cpu_s": cpu, "wall_s": wall}
            row["body_bytes"] = len(body)
            out[f"prompt_{size}"] = row
            print(
                f"overhead: {mode} {size} tokens: seq p50 {row['sequential']['p50_ms']:.2f} ms "
                f"p99 {row['sequential']['p99_ms']:.2f} ms; {rate:g}/s p50 {row['open_loop']['p50_ms']:.2f} "
                f"p99 {row['open_loop']['p99_ms']:.2f} ms; cpu {cpu}",
                flush=True,
            )
        # Highest sustained rate at 1k-token prompts.
        ladder = []
        body = chat_body(1024)
        for rate in LADDER[:3] if short else LADDER:
            (res, _), cpu, wall = measured(stack, open_loop(stack.url, body, rate, 2.0 if short else 4.0))
            st = stats(res)
            ok = st["errors"] == 0 and st["p99_ms"] < 100
            ladder.append({"rate": rate, **st, "cpu_s": cpu, "wall_s": wall, "sustained": ok})
            print(
                f"overhead: {mode} ladder {rate:g}/s p50 {st['p50_ms']:.1f} p99 {st['p99_ms']:.1f} "
                f"errors {st['errors']} cpu {cpu}",
                flush=True,
            )
            if not ok:
                break
        out["ladder_1k"] = ladder
        # Streamed answers: 100 SSE chunks 2 ms apart per request.
        sbody = chat_body(1024, stream=True)
        n_stream = 20 if short else 60
        seq, cpu, _ = measured(stack, sequential(stack.url, sbody, n_stream, stream=True))
        out["stream_sequential"] = {**stats(seq), "cpu_s": cpu, "n": n_stream, "chunks": STREAM_CHUNKS}
        (res, _), cpu, wall = measured(stack, open_loop(stack.url, sbody, 20.0, duration, stream=True))
        out["stream_open_loop"] = {**stats(res), "rate": 20.0, "cpu_s": cpu, "chunks": STREAM_CHUNKS}
    finally:
        stack.stop()
    out.update(adversarial(mode, duration))
    return out


BIG_BODY_BYTES = 500_000
BIG_RATE = 4.0
SMALL_RATE = 50.0


def adversarial(mode: str, duration: float) -> dict[str, Any]:
    """Small 1k-token requests at 50/s, alone and while 500 KB whitespace bodies arrive at 4/s.

    For the sidecar a heartbeat in its own event loop (bench/overhead/lagprobe.py) measures the loop lag
    directly; the small requests' latency shows what other streams see end to end.
    """
    probe = Path(tempfile.mkdtemp(prefix="bench-lag-")) / "lag.json" if mode == "sidecar" else None
    stack = Stack(mode, lag_probe=probe).start()
    out: dict[str, Any] = {}
    try:
        small = chat_body(1024)
        big = chat_body(0, content=" " * BIG_BODY_BYTES)
        t0 = time.time()
        (res, _), cpu, _ = measured(stack, open_loop(stack.url, small, SMALL_RATE, duration))
        t1 = time.time()
        out["adversarial_baseline"] = {**stats(res), "cpu_s": cpu}
        (res, extra), cpu, _ = measured(
            stack, open_loop(stack.url, small, SMALL_RATE, duration, extra=big, extra_rate=BIG_RATE)
        )
        t2 = time.time()
        out["adversarial"] = {**stats(res), "big": stats(extra), "cpu_s": cpu, "big_rate": BIG_RATE}
    finally:
        stack.stop()
    if probe is not None and probe.is_file():
        lags = json.loads(probe.read_text())
        for key, lo, hi in (("adversarial_baseline", t0, t1), ("adversarial", t1, t2)):
            window = [lag for t, lag in lags if lo <= t < hi]
            out[key]["loop_lag_p50_ms"] = percentile(window, 50)
            out[key]["loop_lag_p99_ms"] = percentile(window, 99)
            out[key]["loop_lag_max_ms"] = max(window) if window else None
    lag = out["adversarial"].get("loop_lag_p99_ms")
    print(
        f"overhead: {mode} small p99 {out['adversarial_baseline']['p99_ms']:.1f} -> "
        f"{out['adversarial']['p99_ms']:.1f} ms with 500 KB bodies; loop lag p99 {lag} ms",
        flush=True,
    )
    return out


def run_body_modes(short: bool) -> list[dict[str, Any]]:
    """Response-body modes for a streamed answer: cost per request with STREAMED, NONE and observability."""
    rows = []
    n = 20 if short else 60
    sbody = chat_body(1024, stream=True)
    for mode, body_mode in (
        ("noop", "STREAMED"),
        ("noop", "NONE"),
        ("noop", "OBSERVABILITY"),
        ("sidecar", "STREAMED"),
        ("sidecar", "NONE"),
    ):
        stack = Stack(mode, body_mode).start()
        try:
            seq, cpu, _ = measured(stack, sequential(stack.url, sbody, n, stream=True))
        finally:
            stack.stop()
        rows.append({"mode": mode, "body_mode": body_mode, **stats(seq), "cpu_s": cpu, "n": n})
        print(
            f"overhead: {mode} response body {body_mode}: p50 {rows[-1]['p50_ms']:.1f} ms cpu {cpu}",
            flush=True,
        )
    return rows


def run(short: bool) -> dict[str, Any]:
    t0 = time.monotonic()
    modes = [run_mode(m, short) for m in ("envoy", "noop", "sidecar")]
    result = {
        "short": short,
        "stream_chunks": STREAM_CHUNKS,
        "chunk_gap_ms": CHUNK_GAP_MS,
        "modes": modes,
        "body_modes": [] if short else run_body_modes(short),
        "duration_s": time.monotonic() - t0,
    }
    write_json(f"overhead{'-short' if short else ''}.json", result)
    return result
