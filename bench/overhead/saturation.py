"""How many admissions one sidecar process sustains, and what a second process on the same store adds:
`python -m bench.overhead.saturation [--profile lean|inline] [--processes N] [--store local|redis]
[--clients 1,2,4,...] [--requests N]`.

The no-op upstream of `upstream.py` (JSON answers at once), Envoy (`--concurrency 1`, the profile's rendered
config, its ext_proc cluster listing every sidecar process) and N sidecar processes with the admit-all
config of `profiles.py` (no limits, no feedback: what saturates is the process, not a limit), sharing one
Redis with `--store redis`. A closed-loop ladder of 1k-token chat
requests (1, 2, 4 ... 32 clients, each sending its next request when its answer is in) measures, per step,
answers per second, p50/p99, and the CPU of the sidecar processes and of Envoy per answer (utime + stime from
/proc); the knee is the fewest clients that reach 90 % of the highest throughput: past it, more clients only
queue. (An open-loop ladder stalled on this shared machine: p99s of half a second at 100/s, the generator's
own pauses.) The load generator runs on
the same cores as everything else: on a shared 2-core machine the knee is where the machine runs out, and
the CPU per admission is the figure to carry to a bigger one.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from bench.common import percentile, proc_cpu_seconds, validate_envoy_config, write_json
from bench.overhead.main import _wait_port
from bench.overhead.profiles import admit_all, chat, closed_loop
from devstack.envoy import render_envoy_config
from devstack.processes import Ports, Process, envoy_command, free_port, wait_http
from extproc.config import parse_config

LADDER = (1, 2, 4, 8, 16, 32)


def sidecar_config(grpc: int, admin: int, redis_port: int | None) -> dict[str, Any]:
    config = admit_all()
    config["server"] = {"grpc_listen": f"127.0.0.1:{grpc}", "admin_listen": f"127.0.0.1:{admin}"}
    if redis_port is not None:
        config["store"] = {"backend": "redis", "redis": {"url": f"redis://127.0.0.1:{redis_port}/0"}}
    return config


@dataclass
class Stack:
    profile: str
    processes_n: int
    store: str
    ports: Ports = field(default_factory=Ports.free)
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="bench-saturation-")))
    processes: dict[str, Process] = field(default_factory=dict)
    grpc: list[int] = field(default_factory=list)
    admin: list[int] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.ports.envoy}"

    @property
    def sidecars(self) -> list[str]:
        return [f"sidecar-{i}" for i in range(self.processes_n)]

    def start(self) -> Stack:
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self) -> None:
        py = sys.executable
        up = Process.start(
            "upstream",
            [py, "-m", "bench.overhead.upstream", "--port", str(self.ports.upstream)],
            self.workdir,
        )
        self.processes["upstream"] = up
        redis_port = free_port() if self.store == "redis" else None
        if redis_port is not None:
            argv = ["redis-server", "--port", str(redis_port), "--bind", "127.0.0.1", "--save", ""]
            argv += ["--appendonly", "no", "--dir", str(self.workdir)]
            self.processes["redis"] = Process.start("redis", argv, self.workdir)
            _wait_port(redis_port, self.processes["redis"])
        config = None
        for name in self.sidecars:
            grpc, admin = free_port(), free_port()
            self.grpc.append(grpc)
            self.admin.append(admin)
            raw = sidecar_config(grpc, admin, redis_port)
            config = parse_config(raw)
            path = self.workdir / f"{name}.yaml"
            path.write_text(yaml.safe_dump(raw))
            self.processes[name] = Process.start(
                name, [py, "-m", "extproc", "serve", "--config", str(path)], self.workdir
            )
        envoy = render_envoy_config(self.ports, profile=self.profile, sidecar=config)
        for cluster in envoy["static_resources"]["clusters"]:
            if cluster["name"] == "llm_admission_extproc":
                endpoints = [
                    {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": p}}}}
                    for p in self.grpc
                ]
                cluster["load_assignment"]["endpoints"] = [{"lb_endpoints": endpoints}]
        path = self.workdir / "envoy.yaml"
        path.write_text(yaml.safe_dump(envoy))
        validate_envoy_config(path)
        self.processes["envoy"] = Process.start(
            "envoy", envoy_command(path, self.ports.envoy_admin), self.workdir
        )
        wait_http(f"http://127.0.0.1:{self.ports.upstream}/metrics", proc=up)
        for name, admin in zip(self.sidecars, self.admin, strict=True):
            wait_http(f"http://127.0.0.1:{admin}/readyz", proc=self.processes[name])
        wait_http(f"http://127.0.0.1:{self.ports.envoy_admin}/ready", proc=self.processes["envoy"])

    def stop(self) -> None:
        for name in ["envoy", *self.sidecars, "redis", "upstream"]:
            proc = self.processes.pop(name, None)
            if proc is not None:
                proc.stop()

    def cpu(self) -> dict[str, float]:
        return {name: proc_cpu_seconds(proc.popen.pid) for name, proc in self.processes.items()}

    def end_reports(self) -> dict[str, float]:
        """Lean profile: end reports matched and unknown, over every sidecar process."""
        out = {"matched": 0.0, "unknown": 0.0}
        for admin in self.admin:
            with urllib.request.urlopen(f"http://127.0.0.1:{admin}/metrics", timeout=5) as reply:
                text = reply.read().decode()
            for result in out:
                found = re.search(rf'^extproc_end_reports_total{{result="{result}"}} (\S+)', text, re.M)
                out[result] += float(found.group(1)) if found else 0.0
        return out


def step(stack: Stack, clients: int, requests: int) -> dict[str, Any]:
    body = chat(1024)
    before = stack.cpu()
    t0 = time.monotonic()
    results = asyncio.run(closed_loop(stack.url, body, clients, requests))
    wall = time.monotonic() - t0
    after = stack.cpu()
    cpu = {name: after[name] - before[name] for name in after}
    ok = [r[0] * 1000 for r in results if r is not None]
    sidecar_cpu = sum(cpu[name] for name in stack.sidecars)
    return {
        "clients": clients,
        "requests": len(results),
        "errors": len(results) - len(ok),
        "answers_per_s": len(ok) / wall,
        "p50_ms": percentile(ok, 50),
        "p99_ms": percentile(ok, 99),
        "wall_s": wall,
        "sidecar_cores": sidecar_cpu / wall,
        "sidecar_cpu_us_per_answer": sidecar_cpu / max(1, len(ok)) * 1e6,
        "envoy_cores": cpu["envoy"] / wall,
        "envoy_cpu_us_per_answer": cpu["envoy"] / max(1, len(ok)) * 1e6,
    }


def knee(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The fewest clients whose answers per second reach 90 % of the most any step reached: past it, more
    clients only queue (latency grows, throughput does not)."""
    clean = [r for r in rows if r["errors"] == 0]
    if not clean:
        return None
    peak = max(r["answers_per_s"] for r in clean)
    return next(r for r in clean if r["answers_per_s"] >= 0.9 * peak)


def run(profile: str, processes: int, store: str, ladder: list[int], requests: int) -> dict[str, Any]:
    stack = Stack(profile, processes, store).start()
    rows = []
    try:
        step(stack, 4, 200)  # warm-up
        for clients in ladder:
            row = step(stack, clients, requests)
            rows.append(row)
            print(
                f"saturation: {profile} x{processes} ({store}) {clients} clients: "
                f"{row['answers_per_s']:.0f} answers/s p50 {row['p50_ms']:.1f} p99 {row['p99_ms']:.1f} ms "
                f"errors {row['errors']}; sidecar {row['sidecar_cores']:.2f} cores, "
                f"{row['sidecar_cpu_us_per_answer']:.0f} µs/answer; Envoy {row['envoy_cores']:.2f} cores",
                flush=True,
            )
        reports = stack.end_reports() if profile == "lean" else None
    finally:
        stack.stop()
    best = knee(rows)
    result = {
        "profile": profile,
        "processes": processes,
        "store": store,
        "requests_per_step": requests,
        "steps": rows,
        "knee": best,
        "end_reports": reports,
    }
    write_json(f"saturation-{profile}-x{processes}-{store}.json", result)
    if best is not None:
        print(
            f"saturation: knee at {best['clients']} clients: {best['answers_per_s']:.0f} answers/s, p99 "
            f"{best['p99_ms']:.1f} ms, {1e6 / best['sidecar_cpu_us_per_answer']:.0f} admits per sidecar "
            f"CPU-second; end reports {reports}"
        )
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--profile", default="lean", choices=("lean", "inline"))
    parser.add_argument("--processes", type=int, default=1)
    parser.add_argument("--store", default="local", choices=("local", "redis"))
    parser.add_argument("--clients", default=",".join(str(c) for c in LADDER))
    parser.add_argument("--requests", type=int, default=800, help="per step")
    args = parser.parse_args()
    run(args.profile, args.processes, args.store, [int(c) for c in args.clients.split(",")], args.requests)
