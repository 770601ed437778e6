"""Soak and chaos: 3 sidecar replicas behind one Envoy, one Redis, the simulator and the KV exporter.

`python -m bench.soak --requests N` (or `python -m bench --only soak [--full]`). Closed-loop clients send
N requests through Envoy, half streamed, 10% of them abandoned by the client mid-way, while these faults
are injected one after the other, each at a fixed fraction of the run:

- sidecar-kill: one replica SIGKILLed and started again (its leases are left to the lease TTL);
- redis-pause: Redis SIGSTOPped for 2 s (the replicas fall back to their share, then come back);
- exporter-restart: the KV exporter stopped and started (the feed goes stale, limits sit at the safe scale);
- configmap: every replica's config file rewritten with new token limits (hot reload).

Envoy's ext_proc cluster lists the three replicas, with gRPC health checks every 0.5 s and no panic mode, so
that a dead replica stops receiving streams (what a Kubernetes Service does through readiness).

Invariants, printed PASS/FAIL (the exit code is 1 if any fails):
- the simulator never ran more requests than the global limit (running + waiting, sampled every 20 ms);
- no leaked slots: after the load, once the killed replica's lease TTL has passed, Redis holds no lease;
- no leaked slots or tokens in the ledgers: every live replica has no admitted request left unsettled, and
  its reserved tokens all settled (reserved = settled + refunded - overrun);
- every request ended (none hung past the deadline).

Also reported: requests refused or failed per fault and for how long, decision latency p99 per phase,
Redis commands and Redis CPU per 1,000 requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import math
import os
import random
import re
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import redis
import yaml

from bench.common import write_json
from devstack.envoy import render_envoy_config
from devstack.processes import Ports, Process, envoy_command, exporter_command, free_port, wait_http

MODEL = "llama-3-8b"
REPLICAS = 3
GLOBAL_SLOTS = 24
CLIENTS = 48  # twice the global limit: the limit binds, 429s are part of the normal picture
ABANDON = 0.10
MIN_FAULT_WINDOW_S = 5.0  # traffic seen after each fault before the next one (and after the last)
STREAMED = 0.5
LEASE_TTL_S = 10.0  # short, so the killed replica's leases are seen to expire within the run's tail
REDIS_PAUSE_S = 2.0
FAULTS = (("sidecar-kill", 0.15), ("redis-pause", 0.35), ("exporter-restart", 0.55), ("configmap", 0.75))
SIM_ARGS = ("--time-scale", "20", "--max-num-seqs", "256", "--log-level", "WARNING")


def sidecar_config(
    grpc: int, admin: int, redis_url: str, exporter: int, tpm: int, on_unavailable: str
) -> dict[str, Any]:
    return {
        "server": {
            "grpc_listen": f"127.0.0.1:{grpc}",
            "admin_listen": f"127.0.0.1:{admin}",
            "config_poll_seconds": 0.5,
            "shutdown_grace_seconds": 2,
        },
        "models": {"*": {"context_window": 8192, "default_max_tokens": 256}},
        "limits": {
            "global": {"max_concurrency": GLOBAL_SLOTS, "tokens_per_minute": tpm},
            "models": {MODEL: {"max_concurrency": GLOBAL_SLOTS, "tokens_per_minute": tpm}},
        },
        "store": {
            "backend": "redis",
            "on_unavailable": on_unavailable,
            "fallback_share": round(1 / REPLICAS, 4),
            "redis": {"url": redis_url, "timeout_ms": 50, "lease_ttl_seconds": LEASE_TTL_S},
        },
        "feedback": {"exporters": [f"127.0.0.1:{exporter}"]},
        "adaptive": {
            "low_watermark": 0.7,
            "high_watermark": 0.85,
            "min_scale": 0.6,
            "recovery_per_second": 0.5,
        },
        "log_level": "warning",
    }


def envoy_config(ports: Ports, grpc_ports: list[int]) -> dict[str, Any]:
    """The repo's Envoy config; its ext_proc cluster lists every replica, health-checked."""
    config = render_envoy_config(ports)
    for cluster in config["static_resources"]["clusters"]:
        if cluster["name"] != "llm_admission_extproc":
            continue
        cluster["load_assignment"]["endpoints"] = [
            {
                "lb_endpoints": [
                    {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": p}}}}
                    for p in grpc_ports
                ]
            }
        ]
        cluster["health_checks"] = [
            {
                "timeout": "0.5s",
                "interval": "0.5s",
                "unhealthy_threshold": 1,
                "healthy_threshold": 1,
                # Envoy checks at no_traffic_interval (default 60 s) until the cluster has seen traffic; the
                # ext_proc streams did not count as such here (a killed replica stayed "healthy" without it).
                "no_traffic_interval": "0.5s",
                "grpc_health_check": {"service_name": "envoy.service.ext_proc.v3.ExternalProcessor"},
            }
        ]
        # Never route to a replica that failed its health check. Envoy's default panic threshold is 50%: below
        # it, it balances over every host whatever its health (envoyproxy.io/docs/envoy/latest/intro/
        # arch_overview/upstream/load_balancing/panic_threshold), the dead replica too.
        cluster["common_lb_config"] = {"healthy_panic_threshold": {"value": 0.0}}
    return config


@dataclass
class Outcome:
    start: float
    end: float = math.nan
    kind: str = "pending"  # ok | limited | unavailable | error | abandoned | conn_error | hung
    status: int = 0
    reason: str = ""


@dataclass
class Stack:
    workdir: Path
    ports: Ports = field(default_factory=Ports.free)
    grpc: list[int] = field(default_factory=lambda: [free_port() for _ in range(REPLICAS)])
    admin: list[int] = field(default_factory=lambda: [free_port() for _ in range(REPLICAS)])
    redis_port: int = field(default_factory=free_port)
    procs: dict[str, Process] = field(default_factory=dict)
    tpm: int = 3_000_000
    on_unavailable: str = "local"

    @property
    def redis_url(self) -> str:
        return f"redis://127.0.0.1:{self.redis_port}/0"

    def config_path(self, i: int) -> Path:
        return self.workdir / f"sidecar-{i}.yaml"

    def write_configs(self) -> None:
        for i in range(REPLICAS):
            cfg = sidecar_config(
                self.grpc[i],
                self.admin[i],
                self.redis_url,
                self.ports.exporter,
                self.tpm,
                self.on_unavailable,
            )
            tmp = self.config_path(i).with_suffix(".tmp")
            tmp.write_text(yaml.safe_dump(cfg))
            tmp.replace(self.config_path(i))

    def start(self) -> None:
        py = sys.executable
        self.procs["redis"] = Process.start(
            "redis",
            ["redis-server", "--port", str(self.redis_port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.workdir)],
            self.workdir,
        )  # fmt: skip
        self.procs["simulator"] = Process.start(
            "simulator",
            [py, "-m", "extproc.sim", "--port", str(self.ports.upstream), *SIM_ARGS],
            self.workdir,
        )
        wait_http(f"http://127.0.0.1:{self.ports.upstream}/health", proc=self.procs["simulator"])
        self.start_exporter()
        self.write_configs()
        for i in range(REPLICAS):
            self.start_sidecar(i)
        path = self.workdir / "envoy.yaml"
        path.write_text(yaml.safe_dump(envoy_config(self.ports, self.grpc)))
        self.procs["envoy"] = Process.start(
            "envoy", envoy_command(path, self.ports.envoy_admin), self.workdir
        )
        wait_http(f"http://127.0.0.1:{self.ports.envoy_admin}/ready", proc=self.procs["envoy"])

    def start_exporter(self) -> None:
        upstream = f"http://127.0.0.1:{self.ports.upstream}"
        command = exporter_command(self.ports, "soak", upstream, MODEL)
        self.procs["exporter"] = Process.start("exporter", command, self.workdir)
        wait_http(f"http://127.0.0.1:{self.ports.exporter_metrics}/healthz", proc=self.procs["exporter"])

    def start_sidecar(self, i: int) -> None:
        name = f"sidecar-{i}"
        self.procs[name] = Process.start(
            name,
            [sys.executable, "-m", "extproc", "serve", "--config", str(self.config_path(i))],
            self.workdir,
        )
        wait_http(f"http://127.0.0.1:{self.admin[i]}/readyz", timeout_s=60, proc=self.procs[name])

    def kill(self, name: str) -> None:
        proc = self.procs.pop(name)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.popen.pid, signal.SIGKILL)
        proc.popen.wait(10)
        proc.log_file.close()

    def signal(self, name: str, sig: signal.Signals) -> None:
        os.kill(self.procs[name].popen.pid, sig)

    def stop(self) -> None:
        for name in ["envoy", *[f"sidecar-{i}" for i in range(REPLICAS)], "exporter", "simulator", "redis"]:
            proc = self.procs.pop(name, None)
            if proc is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.popen.pid, signal.SIGCONT)
                proc.stop()


# -- load ---------------------------------------------------------------------------------------------------


async def one(
    session: aiohttp.ClientSession, url: str, rng: random.Random, out: Outcome, abandon_share: float
) -> None:
    stream = rng.random() < STREAMED
    abandon = rng.random() < abandon_share
    want = rng.randint(4, 40)
    body = {"model": MODEL, "prompt": " the" * rng.randint(10, 200), "max_tokens": 64, "stream": stream}
    headers = {"x-sim-output-tokens": str(want), "content-type": "application/json"}
    try:
        async with asyncio.timeout(rng.uniform(0.005, 0.08) if abandon else 60):
            async with session.post(url, data=json.dumps(body), headers=headers) as resp:
                out.status = resp.status
                if resp.status == 429:
                    out.kind, out.reason = "limited", resp.headers.get("x-extproc-reject-reason", "")
                elif resp.status == 503 and resp.headers.get("x-extproc-reject-reason"):
                    out.kind, out.reason = "unavailable", resp.headers["x-extproc-reject-reason"]
                elif resp.status != 200:
                    out.kind = "error"
                if resp.status != 200 or not stream:
                    await resp.read()
                    out.kind = "ok" if out.kind == "pending" else out.kind
                    return
                async for line in resp.content:
                    if line.strip() == b"data: [DONE]":
                        out.kind = "ok"
                        return
                out.kind = "error"  # the stream ended without [DONE]
    except TimeoutError:
        out.kind = "abandoned" if abandon else "hung"
    except aiohttp.ClientError:
        out.kind = "conn_error"
    finally:
        out.end = time.monotonic()


SIM_LOAD = re.compile(r"^vllm:num_requests_(?:running|waiting)\{[^}]*\} (\S+)$", re.M)


async def scrape_sim(
    session: aiohttp.ClientSession, url: str, stop: asyncio.Event, samples: list[tuple[float, float]]
) -> None:
    """(time, running + waiting) in the simulator every 20 ms: the concurrency the backend really saw."""
    while not stop.is_set():
        with contextlib.suppress(aiohttp.ClientError, TimeoutError):
            async with session.get(url, timeout=aiohttp.ClientTimeout(total=1)) as resp:
                text = await resp.text()
            samples.append((time.monotonic(), sum(float(v) for v in SIM_LOAD.findall(text))))
        await asyncio.sleep(0.02)


# -- metrics from the sidecars and Redis ---------------------------------------------------------------------


def metric_lines(text: str, name: str) -> Iterator[tuple[str, float]]:
    for m in re.finditer(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", text, re.M):
        yield m.group(1) or "", float(m.group(2))


async def sidecar_metrics(session: aiohttp.ClientSession, admin: int) -> str | None:
    try:
        async with session.get(
            f"http://127.0.0.1:{admin}/metrics", timeout=aiohttp.ClientTimeout(total=2)
        ) as r:
            return await r.text()
    except (aiohttp.ClientError, TimeoutError):
        return None


def decision_buckets(text: str) -> dict[float, float]:
    out: dict[float, float] = {}
    for labels, value in metric_lines(text, "extproc_decision_seconds_bucket"):
        le = re.search(r'le="([^"]+)"', labels)
        if le:  # summed over the outcome label
            out[float(le.group(1))] = out.get(float(le.group(1)), 0.0) + value
    return out


def p99_of(buckets: dict[float, float]) -> float:
    """Upper bound of the bucket holding the 99th percentile of a cumulative histogram."""
    total = buckets.get(math.inf, 0.0)
    if total <= 0:
        return math.nan
    for bound in sorted(buckets):
        if buckets[bound] >= 0.99 * total:
            return bound
    return math.inf


def redis_counters(client: redis.Redis) -> tuple[float, float, float]:
    """Commands (those inside scripts included), script calls, CPU seconds of the Redis server so far."""
    stats, cpu, calls = client.info("stats"), client.info("cpu"), client.info("commandstats")
    scripts = sum(float(v["calls"]) for k, v in calls.items() if k in ("cmdstat_evalsha", "cmdstat_eval"))
    cpu_s = float(cpu["used_cpu_sys"]) + float(cpu["used_cpu_user"])
    return float(stats["total_commands_processed"]), scripts, cpu_s


def leases_in_redis(client: redis.Redis) -> int:
    return sum(int(client.zcard(k)) for k in client.scan_iter(match="extproc:{limits}:l:*", count=1000))


# -- the run ------------------------------------------------------------------------------------------------


@dataclass
class Phase:
    """From one fault's start to the next one's (the first: the baseline before any fault)."""

    name: str
    start: float
    decisions: dict[int, dict[float, float]]  # per replica: the decision-latency histogram at the start
    injected_s: float = 0.0


@dataclass
class Run:
    total: int
    abandon: float = ABANDON
    outcomes: list[Outcome] = field(default_factory=list)
    phases: list[Phase] = field(default_factory=list)
    backend: list[tuple[float, float]] = field(default_factory=list)
    issued: int = 0


async def drive(stack: Stack, total: int, seed: int, abandon: float) -> dict[str, Any]:
    rng = random.Random(seed)
    run = Run(total, abandon)
    url = f"http://127.0.0.1:{stack.ports.envoy}/v1/completions"
    rclient = redis.Redis(host="127.0.0.1", port=stack.redis_port, socket_timeout=5)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

        async def phase(name: str) -> Phase:
            buckets = {}
            for i, port in enumerate(stack.admin):
                text = await sidecar_metrics(session, port)
                if text is not None:
                    buckets[i] = decision_buckets(text)
            run.phases.append(Phase(name, time.monotonic(), buckets))
            return run.phases[-1]

        faults_done = asyncio.Event()

        async def client() -> None:
            # At least `total` requests, and on until the last fault has had MIN_FAULT_WINDOW_S of traffic.
            while run.issued < total or not faults_done.is_set():
                run.issued += 1
                out = Outcome(time.monotonic())
                run.outcomes.append(out)
                await one(session, url, rng, out, run.abandon)
                if out.kind in ("limited", "unavailable", "conn_error", "error"):
                    await asyncio.sleep(0.01)  # a refused client backs off a little, as real ones do

        async def inject() -> None:
            for name, at in FAULTS:
                ready = time.monotonic() + MIN_FAULT_WINDOW_S  # the previous fault's effects are seen first
                await until(lambda at=at, ready=ready: run.issued >= at * total and time.monotonic() >= ready)
                current = await phase(name)
                await fault(stack, name)
                current.injected_s = time.monotonic() - current.start
            await asyncio.sleep(MIN_FAULT_WINDOW_S)
            faults_done.set()

        await warm_up(session, url)

        stop = asyncio.Event()
        sim_url = f"http://127.0.0.1:{stack.ports.upstream}/metrics"
        scraper = asyncio.create_task(scrape_sim(session, sim_url, stop, run.backend))
        commands0, evals0, cpu0 = redis_counters(rclient)
        await phase("baseline")
        t0 = time.monotonic()
        injector = asyncio.create_task(inject())
        await asyncio.gather(*(client() for _ in range(CLIENTS)))
        await injector
        load_s = time.monotonic() - t0
        await phase("end")
        stop.set()
        await scraper
        commands1, evals1, cpu1 = redis_counters(rclient)
        # The killed replica's leases expire after the lease TTL; every other lease is settled by now.
        await until(lambda: leases_in_redis(rclient) == 0, LEASE_TTL_S + 10)
        left = leases_in_redis(rclient)
        ledgers = [await ledger(session, i, port) for i, port in enumerate(stack.admin)]
    rclient.close()
    redis_use = {
        "commands_per_1000_requests": round((commands1 - commands0) / run.issued * 1000),
        "script_calls_per_1000_requests": round((evals1 - evals0) / run.issued * 1000),
        "cpu_seconds_per_1000_requests": round((cpu1 - cpu0) / run.issued * 1000, 3),
    }
    return summarize(run, ledgers, left, load_s, redis_use)


async def warm_up(session: aiohttp.ClientSession, url: str) -> None:
    """A few requests through every replica before measuring: the first ones load the tokenizer."""
    body = json.dumps({"model": MODEL, "prompt": "warm", "max_tokens": 4})
    headers = {"x-sim-output-tokens": "2", "content-type": "application/json"}
    for _ in range(4 * REPLICAS):
        with contextlib.suppress(aiohttp.ClientError):
            async with session.post(url, data=body, headers=headers) as resp:
                await resp.read()


async def until(check: Any, limit_s: float = 3600.0) -> None:
    deadline = time.monotonic() + limit_s
    while True:
        if check() or time.monotonic() > deadline:
            return
        await asyncio.sleep(0.05)


async def ledger(session: aiohttp.ClientSession, replica: int, port: int) -> dict[str, Any]:
    """A replica's own account: admitted requests not settled, tokens reserved and not settled."""
    text = await sidecar_metrics(session, port) or ""

    def total(name: str) -> float:
        return sum(v for _, v in metric_lines(text, name))

    tokens = (
        total("extproc_tokens_reserved_total")
        - total("extproc_tokens_refunded_total")
        + total("extproc_tokens_overrun_total")
        - total("extproc_tokens_settled_total")
    )
    return {
        "replica": replica,
        "unsettled_requests": total("extproc_active_requests"),
        "unsettled_tokens": tokens,
    }


async def fault(stack: Stack, name: str) -> None:
    if name == "sidecar-kill":
        stack.kill("sidecar-1")
        await asyncio.sleep(1.0)
        await asyncio.to_thread(stack.start_sidecar, 1)
    elif name == "redis-pause":
        stack.signal("redis", signal.SIGSTOP)
        await asyncio.sleep(REDIS_PAUSE_S)
        stack.signal("redis", signal.SIGCONT)
    elif name == "exporter-restart":
        await asyncio.to_thread(stack.procs.pop("exporter").stop)
        await asyncio.sleep(1.0)
        await asyncio.to_thread(stack.start_exporter)
    elif name == "configmap":
        stack.tpm = stack.tpm * 2 // 3
        stack.write_configs()


FAILED = ("unavailable", "error", "conn_error", "hung")


def summarize(
    run: Run, ledgers: list[dict[str, Any]], left: int, load_s: float, redis_use: dict[str, Any]
) -> dict[str, Any]:
    kinds: dict[str, int] = {}
    for o in run.outcomes:
        kinds[o.kind] = kinds.get(o.kind, 0) + 1
    phases = []
    for current, following in itertools.pairwise(run.phases):
        lo, hi = current.start, following.start
        ended = [o for o in run.outcomes if lo <= o.end < hi]
        failed = [o for o in ended if o.kind in FAILED]
        backend = [v for t, v in run.backend if lo <= t < hi]
        phases.append(
            {
                "phase": current.name,
                "seconds": round(hi - lo, 1),
                "injection_s": round(current.injected_s, 1),
                "requests_ended": len(ended),
                "limited_429": sum(1 for o in ended if o.kind == "limited"),
                "failed": len(failed),
                "failed_by_status": _count(f"{o.kind}:{o.status}" for o in failed),
                "failed_for_s": round(max(o.end for o in failed) - lo, 1) if failed else 0.0,
                # seconds after the phase start (0.5 s bins) -> failures ending then, for the diagnosis
                "failures_over_time": _count(f"{(o.end - lo) // 0.5 * 0.5:.1f}s" for o in failed),
                "decision_p99_s": p99_of(_delta(current.decisions, following.decisions)),
                "backend_peak": max(backend, default=math.nan),
            }
        )
    peak = max((v for _, v in run.backend), default=math.nan)
    checks = {
        f"backend never above the global limit ({GLOBAL_SLOTS})": peak <= GLOBAL_SLOTS,
        "no lease left in Redis": left == 0,
        "no unsettled request in any ledger": all(x["unsettled_requests"] == 0 for x in ledgers),
        "no unsettled token in any ledger": all(abs(x["unsettled_tokens"]) < 0.5 for x in ledgers),
        "every request ended": kinds.get("hung", 0) == 0 and kinds.get("pending", 0) == 0,
    }
    return {
        "requests": run.issued,
        "requests_asked": run.total,
        "abandon_share": run.abandon,
        "load_seconds": round(load_s, 1),
        "requests_per_second": round(run.issued / load_s, 1),
        "outcomes": kinds,
        "global_limit": GLOBAL_SLOTS,
        "backend_peak_running_plus_waiting": peak,
        "backend_samples": len(run.backend),
        "leases_left_in_redis": left,
        "ledgers": ledgers,
        "phases": phases,
        "redis": redis_use,
        "checks": checks,
    }


def _count(items: Iterator[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for item in items:
        out[item] = out.get(item, 0) + 1
    return out


def _delta(before: dict[int, dict[float, float]], after: dict[int, dict[float, float]]) -> dict[float, float]:
    """Decision histogram of a phase, all replicas together; a replica restarted meanwhile starts from 0."""
    merged: dict[float, float] = {}
    for replica, buckets in after.items():
        start = before.get(replica, {})
        if buckets.get(math.inf, 0.0) < start.get(math.inf, 0.0):
            start = {}
        for bound, value in buckets.items():
            merged[bound] = merged.get(bound, 0.0) + value - start.get(bound, 0.0)
    return merged


def fallback_episodes(workdir: Path) -> dict[str, int]:
    """Times each replica switched to its local fallback (one log line per switch; since its last start)."""
    return {
        log.stem: sum(
            "shared store unavailable" in line for line in log.read_text(errors="replace").splitlines()
        )
        for log in sorted(workdir.glob("sidecar-*.log"))
    }


def run(
    requests: int, seed: int = 1, keep: bool = False, abandon: float = ABANDON, on_unavailable: str = "local"
) -> int:
    workdir = Path(tempfile.mkdtemp(prefix="extproc-soak-"))
    stack = Stack(workdir, on_unavailable=on_unavailable)
    try:
        stack.start()
        result = asyncio.run(drive(stack, requests, seed, abandon))
    finally:
        stack.stop()
    result["on_unavailable"] = on_unavailable
    result["fallback_episodes"] = fallback_episodes(workdir)
    result["command"] = (
        f"python -m bench.soak --requests {requests} --seed {seed} --abandon {abandon} "
        f"--on-unavailable {on_unavailable}"
    )
    if keep:
        result["workdir"] = str(workdir)
    name = "soak" if requests >= 100_000 else f"soak-{requests}"
    path = write_json(f"{name}-{on_unavailable}.json", result)
    print(json.dumps({k: v for k, v in result.items() if k != "checks"}, indent=1, default=str))
    for check, ok in result["checks"].items():
        print(f"{'PASS' if ok else 'FAIL'}: {check}")
    print(f"soak: results in {path}")
    return 0 if all(result["checks"].values()) else 1
