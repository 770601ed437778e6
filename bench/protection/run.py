"""Replay the Azure traces through Envoy to the simulator, in four modes, and measure what the GPU suffers.

Modes (same trace slice, same simulated deployment, same client):

- `envoy`      Envoy straight to the simulator (no admission control)
- `ratelimit`  Envoy's own `local_ratelimit` filter: a requests/s token bucket at the deployment's capacity
- `static`     Envoy + sidecar, static concurrency and tokens-per-minute limits sized from the KV capacity
- `feedback-lifetime`  Envoy + sidecar with KV-cache feedback, the KV budget booking whole lifetimes
               (the configuration before forecasts, kept for comparison)
- `feedback`   Envoy + sidecar with KV-cache feedback (adaptive scale + KV-token budget by forecast)

Time is compressed with the simulator's `--time-scale T`: every latency the client measures in wall seconds
is multiplied by T to read as engine (deployment) seconds, and every rate the proxies enforce (Envoy's
token bucket, the sidecar's TPM) is multiplied by T, because those run on wall time. T is chosen per
arrival-rate multiplier so the wall request rate stays the same (the load generator, Envoy and the sidecar
share two CPU cores); the simulator's engine clock keeps modelled latencies exact either way.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from bench.common import parse_prometheus, percentile, validate_envoy_config
from bench.protection import trace as tr
from bench.protection.trace import TraceRequest
from devstack.processes import Ports
from devstack.stack import LocalStack

MODEL = "llama-3-8b"
HERE = Path(__file__).resolve().parent
RATELIMIT_TEMPLATE = HERE / "envoy_ratelimit.yaml"


@dataclass(frozen=True)
class Deployment:
    """The simulated replica: the simulator's Llama-3-8B bf16 on one H100 80GB, with a smaller KV share.

    Why not the simulator's default (gpu_memory_utilization 0.9, 27,551 blocks = 440k tokens): the
    conversation trace needs ~11k KV tokens on average at its real rate (Little's law: 5.5 req/s x mean
    token-seconds per request), so that cache never gets past a few percent even at 4x. The deployment
    here gives vLLM 30 % of the GPU (`--gpu-memory-utilization 0.3`, as when a second model shares the GPU):
    79.19 GiB x 0.3 - 14.96 GiB weights - 2.5 GiB activations = 6.30 GiB = 3,224 blocks of 2 MiB =
    51,584 tokens. Timing stays the simulator's H100 profile (6.5 ms step, 0.1 ms per sequence, 0.04 ms
    per prefill token), so compute is not what saturates first at 1x-2x: the KV cache is.
    """

    gpu_memory_gib: float = 79.19
    gpu_memory_utilization: float = 0.3
    weights_gib: float = 14.96
    overhead_gib: float = 2.5
    block_size: int = 16
    max_model_len: int = 8192
    step_base_ms: float = 6.5
    decode_per_seq_ms: float = 0.1
    prefill_per_token_ms: float = 0.04

    @property
    def num_gpu_blocks(self) -> int:
        kv_gib = self.gpu_memory_gib * self.gpu_memory_utilization - self.weights_gib - self.overhead_gib
        block_bytes = self.block_size * 2 * 32 * 8 * 128 * 2  # K and V x layers x KV heads x head dim x bf16
        return int(kv_gib * 2**30 // block_bytes)

    @property
    def kv_tokens(self) -> int:
        return self.num_gpu_blocks * self.block_size

    def sim_args(self, time_scale: float, overflow: str, max_model_len: int | None = None) -> list[str]:
        return [
            "--gpu-memory-utilization",
            str(self.gpu_memory_utilization),
            "--max-model-len",
            str(max_model_len or self.max_model_len),
            "--overflow",
            overflow,
            "--time-scale",
            f"{time_scale:.4f}",
            "--log-level",
            "WARNING",
        ]


@dataclass(frozen=True)
class Sizing:
    """Limits derived from the deployment's KV capacity (see RESULTS.md for the arithmetic)."""

    concurrency: int
    tokens_per_minute: int  # engine minutes
    requests_per_second: float  # engine seconds, for Envoy's local rate limit
    mean_footprint: float
    mean_duration_s: float


def size_limits(dep: Deployment, trace: list[TraceRequest], target_utilization: float = 0.9) -> Sizing:
    """Static limits from the KV capacity and the trace's mean request shape.

    concurrency = KV tokens x target / mean final footprint (prompt + generated): the number of average
    requests whose KV fits. Mean duration at that batch size = prefill + generated x step(concurrency);
    capacity (req/s) = concurrency / mean duration (Little's law); TPM = capacity x mean footprint x 60.
    """
    footprint = sum(r.context + r.generated for r in trace) / len(trace)
    concurrency = int(dep.kv_tokens * target_utilization // footprint)
    step_s = (dep.step_base_ms + dep.decode_per_seq_ms * concurrency) / 1000
    prefill_s = sum(r.context for r in trace) / len(trace) * dep.prefill_per_token_ms / 1000
    duration = prefill_s + sum(r.generated for r in trace) / len(trace) * step_s
    rps = concurrency / duration
    return Sizing(concurrency, int(rps * footprint * 60), rps, footprint, duration)


# -- requests -----------------------------------------------------------------------------------------------


def max_tokens_for(generated: int, prompt: int, max_model_len: int) -> int:
    """Client policy: the trace's generated tokens rounded up to a power of two (a client knows roughly how
    long its answers get, not exactly), at least 16, never past the context window."""
    want = max(16, 1 << max(0, math.ceil(math.log2(max(1, generated)))))
    return max(1, min(want, max_model_len - prompt))


def shape(req: TraceRequest, max_model_len: int) -> tuple[int, int, int]:
    """(prompt tokens, forced output tokens, max_tokens) for one trace row, capped to the context window."""
    generated = max(1, req.generated)
    prompt = max(1, min(req.context, max_model_len - generated - 1))
    return prompt, generated, max_tokens_for(generated, prompt, max_model_len)


@dataclass
class Result:
    idx: int
    scheduled: float  # wall seconds since replay start
    prompt: int
    want: int
    stream: bool
    burst: bool
    status: int = 0
    outcome: str = "pending"  # ok | rejected | error | timeout
    ttft: float | None = None  # wall seconds from scheduled send time (of the first attempt)
    e2e: float | None = None
    completion: int = 0
    reason: str = ""  # why a 429: the sidecar's x-extproc-reject-reason, or "envoy_local_rate_limit"
    attempts: int = 0


def retry_delay(headers: Any) -> float | None:
    """Seconds a refused client waits before trying again, as OpenAI's SDKs read the answer: None when told
    `x-should-retry: false`, else `retry-after-ms`, else `retry-after`, else one second."""
    if headers.get("x-should-retry") == "false":
        return None
    for name, unit in (("retry-after-ms", 0.001), ("retry-after", 1.0)):
        value = headers.get(name)
        if value is not None:
            try:
                return max(0.0, float(value) * unit)
            except ValueError:
                continue
    return 1.0


async def _one(
    session: aiohttp.ClientSession,
    url: str,
    res: Result,
    max_tokens: int,
    start: float,
    retries: int = 0,
) -> None:
    """One request; with `retries`, a refused one comes back after its `retry-after`, at most that often."""
    while True:
        res.attempts += 1
        delay = await _attempt(session, url, res, max_tokens, start)
        if res.outcome != "rejected" or delay is None or res.attempts > retries:
            return
        await asyncio.sleep(delay)


async def _attempt(
    session: aiohttp.ClientSession,
    url: str,
    res: Result,
    max_tokens: int,
    start: float,
) -> float | None:
    """Send once; on a 429 return how long to wait before retrying (None: do not retry)."""
    body: dict[str, Any] = {
        "model": MODEL,
        "prompt": tr.prompt_text(res.prompt, res.idx),
        "max_tokens": max_tokens,
        "stream": res.stream,
    }
    headers = {"x-sim-output-tokens": str(res.want), "content-type": "application/json"}
    t_sched = start + res.scheduled
    try:
        async with session.post(url, data=json.dumps(body), headers=headers) as resp:
            res.status = resp.status
            if resp.status == 429:
                res.outcome = "rejected"
                res.reason = resp.headers.get("x-extproc-reject-reason") or (
                    "envoy_local_rate_limit" if resp.headers.get("x-local-rate-limit") else "other"
                )
                await resp.read()
                return retry_delay(resp.headers)
            if resp.status != 200:
                res.outcome = "error"
                await resp.read()
                return None
            if not res.stream:
                payload = await resp.json()
                res.completion = int(payload["usage"]["completion_tokens"])
                res.e2e = time.monotonic() - t_sched
                res.outcome = "ok"
                return None
            done = False
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    break
                for choice in chunk.get("choices") or ():
                    if choice.get("text"):
                        if res.ttft is None:
                            res.ttft = time.monotonic() - t_sched
                        res.completion += 1
            res.e2e = time.monotonic() - t_sched
            res.outcome = "ok" if done else "error"
    except asyncio.CancelledError:
        if res.outcome != "rejected":
            res.outcome = "timeout"
        raise
    except (aiohttp.ClientError, ValueError, KeyError) as exc:
        res.outcome = "error"
        res.status = res.status or -1
        del exc
    return None


@dataclass
class Sample:
    t: float
    kv: float
    running: float
    waiting: float
    preemptions: float
    oom: float
    booked: float = math.nan  # the sidecar's KV budget: booked tokens / capacity (NaN without a budget)
    scale: float = math.nan  # the sidecar's adaptive scale


SIDECAR_SERIES = ("extproc_kv_booked_tokens", "extproc_kv_capacity_tokens", "extproc_adaptive_scale_ratio")


async def _get_metrics(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with session.get(url, timeout=aiohttp.ClientTimeout(total=2)) as resp:
        return parse_prometheus(await resp.text())


async def _scrape(
    session: aiohttp.ClientSession,
    url: str,
    start: float,
    out: list[Sample],
    sidecar_url: str | None = None,
) -> None:
    """KV usage and the engine's load every ~100 ms of wall time, and the sidecar's budget when given."""
    while True:
        t = time.monotonic()
        try:
            m = await _get_metrics(session, url)
            sample = Sample(
                t - start,
                m.get("vllm:kv_cache_usage_perc", math.nan),
                m.get("vllm:num_requests_running", math.nan),
                m.get("vllm:num_requests_waiting", math.nan),
                m.get("vllm:num_preemptions_total", 0.0),
                m.get("sim_oom_events_total", 0.0),
            )
            if sidecar_url is not None:
                side = await _get_metrics(session, sidecar_url)
                booked, capacity, scale = (side.get(name, math.nan) for name in SIDECAR_SERIES)
                sample.booked = booked / capacity if capacity else math.nan
                sample.scale = scale
            out.append(sample)
        except (aiohttp.ClientError, TimeoutError):
            pass
        await asyncio.sleep(max(0.0, 0.1 - (time.monotonic() - t)))


@dataclass
class Plan:
    """One replay: which requests go when (engine seconds), and which are streamed."""

    # (engine t, prompt, want, max_tokens, stream, burst)
    arrivals: list[tuple[float, int, int, int, bool, bool]]
    span_s: float  # engine seconds from first to last arrival


def make_plan(
    trace: list[TraceRequest],
    rate: float,
    max_model_len: int,
    stream_every: int,
    burst: tuple[int, int, int] | None = None,
    burst_max_model_len: int | None = None,
) -> Plan:
    """Arrival times compressed by `rate`; every `stream_every`-th request streamed (TTFT measured on those).

    `burst` = (count, prompt tokens, output tokens): that many long-context requests all at the middle of the
    slice, on top of the trace.
    """
    arrivals = []
    for i, req in enumerate(trace):
        prompt, want, max_tokens = shape(req, max_model_len)
        arrivals.append((req.t / rate, prompt, want, max_tokens, i % stream_every == 0, False))
    span = arrivals[-1][0] if arrivals else 0.0
    if burst is not None:
        count, prompt, want = burst
        limit = burst_max_model_len or max_model_len
        at = span / 2
        for _ in range(count):
            arrivals.append((at, prompt, want, max_tokens_for(want, prompt, limit), True, True))
        arrivals.sort(key=lambda a: a[0])
    return Plan(arrivals, span)


async def replay(
    base_url: str,
    sim_url: str,
    plan: Plan,
    time_scale: float,
    drain_engine_s: float,
    retries: int = 0,
    sidecar_url: str | None = None,
) -> tuple[list[Result], list[Sample], float]:
    """Send each request at its scheduled wall time (open loop), scrape the simulator, stop at a deadline.

    The deadline also ends retries: a request still waiting to come back then counts as refused."""
    results: list[Result] = []
    samples: list[Sample] = []
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=5)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        start = time.monotonic() + 0.5
        scraper = asyncio.create_task(_scrape(session, f"{sim_url}/metrics", start, samples, sidecar_url))
        tasks: list[asyncio.Task[None]] = []
        url = f"{base_url}/v1/completions"
        deadline = start + (plan.span_s + drain_engine_s) / time_scale
        for i, (t_eng, prompt, want, max_tokens, stream, burst) in enumerate(plan.arrivals):
            res = Result(i, t_eng / time_scale, prompt, want, stream, burst)
            results.append(res)
            delay = start + res.scheduled - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(_one(session, url, res, max_tokens, start, retries)))
        pending = [t for t in tasks if not t.done()]
        if pending:
            await asyncio.wait(pending, timeout=max(0.0, deadline - time.monotonic()))
        for task in tasks:
            if not task.done():
                task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        # A last scrape after everything ended, so the counters are final.
        await asyncio.sleep(0.3)
        scraper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await scraper
        end = time.monotonic() - start
    return results, samples, end


# -- summary ------------------------------------------------------------------------------------------------


SLO_TTFT_S = 1.0
"""The TTFT objective of SLO goodput, in engine seconds."""

OVERLOAD_FROM = 0.1
"""`kv_mean_overload` averages the KV samples from this fraction of the arrival span to its end: the
replay once the first requests have filled the cache, without the drain after the last arrival."""


def slo_goodput(ok: list[Result], tokens: int, time_scale: float) -> float:
    """Output tokens of completed requests whose TTFT met `SLO_TTFT_S`.

    TTFT is only observed on streamed requests (every `stream_every`-th, spread over the whole trace), so
    the share of streamed output tokens that met the objective is applied to all completed tokens.
    """
    streamed = [r for r in ok if r.stream and r.ttft is not None]
    total = sum(r.completion for r in streamed)
    if not total:
        return math.nan
    met = sum(r.completion for r in streamed if r.ttft is not None and r.ttft * time_scale <= SLO_TTFT_S)
    return tokens * met / total


def summarize(
    results: list[Result], samples: list[Sample], plan: Plan, time_scale: float, wall_s: float
) -> dict[str, Any]:
    """Engine-second figures for one run (wall latencies x time scale)."""
    normal = [r for r in results if not r.burst]
    ok = [r for r in normal if r.outcome == "ok"]
    counts = {k: sum(1 for r in normal if r.outcome == k) for k in ("ok", "rejected", "error", "timeout")}
    ttft = [r.ttft * time_scale for r in ok if r.ttft is not None]
    e2e = [r.e2e * time_scale for r in ok if r.e2e is not None]
    tokens = sum(r.completion for r in ok)
    kv = [s.kv for s in samples if not math.isnan(s.kv)]
    overload = [
        s.kv
        for s in samples
        if not math.isnan(s.kv) and OVERLOAD_FROM * plan.span_s <= s.t * time_scale <= plan.span_s
    ]
    last = samples[-1] if samples else Sample(0, 0, 0, 0, 0, 0)
    out: dict[str, Any] = {
        "requests": len(normal),
        **counts,
        "attempts": sum(r.attempts for r in normal),
        "refused_attempts": sum(r.attempts - (r.outcome != "rejected") for r in normal if r.attempts),
        "rejection_rate": counts["rejected"] / max(1, len(normal)),
        "reject_reasons": {
            reason: sum(1 for r in normal if r.outcome == "rejected" and r.reason == reason)
            for reason in sorted({r.reason for r in normal if r.outcome == "rejected"})
        },
        "failure_rate": (counts["error"] + counts["timeout"]) / max(1, len(normal)),
        "error_statuses": {
            str(status): sum(1 for r in normal if r.outcome == "error" and r.status == status)
            for status in sorted({r.status for r in normal if r.outcome == "error"})
        },
        "goodput_tok_s": tokens / plan.span_s if plan.span_s else math.nan,
        "slo_goodput_tok_s": slo_goodput(ok, tokens, time_scale) / plan.span_s if plan.span_s else math.nan,
        "completed_output_tokens": tokens,
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
        "e2e_p50_s": percentile(e2e, 50),
        "e2e_p99_s": percentile(e2e, 99),
        "kv_peak": max(kv) if kv else math.nan,
        "kv_mean": sum(kv) / len(kv) if kv else math.nan,
        "kv_mean_overload": sum(overload) / len(overload) if overload else math.nan,
        "preemptions": last.preemptions,
        "oom_events": last.oom,
        "time_scale": time_scale,
        "span_engine_s": plan.span_s,
        "wall_s": wall_s,
    }
    burst = [r for r in results if r.burst]
    if burst:
        bok = [r for r in burst if r.outcome == "ok"]
        out["burst_outcome"] = {
            "count": len(burst),
            **{k: sum(1 for r in burst if r.outcome == k) for k in ("ok", "rejected", "error", "timeout")},
            "e2e_p50_s": percentile([r.e2e * time_scale for r in bok if r.e2e is not None], 50),
        }
    return out


# -- modes --------------------------------------------------------------------------------------------------


def sidecar_config(
    sizing: Sizing,
    time_scale: float,
    context_window: int,
    feedback_url: str | None = None,
    booking: str = "forecast",
) -> dict[str, Any]:
    """Sidecar limits on the sidecar's wall clock (tokens per minute = engine TPM x time scale).

    Static mode: the KV-sized concurrency and TPM. Feedback modes: twice those as a ceiling (the KV budget
    and the adaptive scale do the sizing from what the engine reports), the simulator scraped directly
    once per engine second, and the controller's time constants (recovery per second, staleness) converted
    to wall seconds so that they mean in engine time what the defaults mean on a real deployment.

    `booking` "forecast" (the `feedback` mode) lets the KV budget bind: the adaptive KV term starts above
    the budget's target (0.92-0.98), as a backstop for KV the budget cannot see, and the queue term stays.
    "lifetime" (the `feedback-lifetime` mode) is the configuration before forecasts: lifetime booking and
    the default watermarks 0.70-0.85.
    """
    factor = 1 if feedback_url is None else 2
    config: dict[str, Any] = {
        "admission": {"max_body_bytes": 1 << 20},
        "models": {"*": {"context_window": context_window, "default_max_tokens": 1024}},
        "limits": {
            "models": {
                MODEL: {
                    "max_concurrency": sizing.concurrency * factor,
                    "tokens_per_minute": int(sizing.tokens_per_minute * time_scale * factor),
                }
            }
        },
        "log_level": "warning",
    }
    if feedback_url is not None:
        forecast = booking == "forecast"
        config["feedback"] = {
            "direct_targets": [{"url": feedback_url, "kind": "vllm", "model": MODEL}],
            "scrape_interval_seconds": max(0.05, round(1.0 / time_scale, 3)),
        }
        config["adaptive"] = {
            "low_watermark": 0.92 if forecast else 0.70,
            "high_watermark": 0.98 if forecast else 0.85,
            "min_scale": 0.6,
            "recovery_per_second": round(0.05 * time_scale, 4),
            "stale_after_seconds": max(1.0, round(5.0 / time_scale, 3)),
        }
        config["kv_budget"] = {"enabled": True, "target_utilization": 0.9, "booking": booking}
    return config


def ratelimit_template(workdir: Path, rps_wall: float) -> Path:
    """Envoy's local rate limit at `rps_wall` requests per wall second, as a rendered template file.

    Envoy refills the bucket every `fill_interval`; an interval of ~100 ms with an integer fill keeps the
    average rate within a few percent of the target. The bucket holds one second of requests (burst).
    """
    config = yaml.safe_load(RATELIMIT_TEMPLATE.read_text())
    per_fill = max(1, round(rps_wall * 0.1))
    interval_ms = max(1, round(per_fill / rps_wall * 1000))
    for listener in config["static_resources"]["listeners"]:
        for chain in listener["filter_chains"]:
            for f in chain["filters"]:
                for hf in f["typed_config"]["http_filters"]:
                    if hf["name"] == "envoy.filters.http.local_ratelimit":
                        bucket = hf["typed_config"]["token_bucket"]
                        bucket["max_tokens"] = max(per_fill, math.ceil(rps_wall))
                        bucket["tokens_per_fill"] = per_fill
                        bucket["fill_interval"] = f"{interval_ms / 1000:.3f}s"
    path = workdir / "envoy_ratelimit.rendered.yaml"
    path.write_text(yaml.safe_dump(config))
    validate_envoy_config(path)
    return path


MODES = ("envoy", "ratelimit", "static", "feedback-lifetime", "feedback")


@dataclass
class RunSpec:
    mode: str
    rate: float
    overflow: str
    time_scale: float
    burst: bool = False
    extra: dict[str, Any] = field(default_factory=dict)
    retries: int = 0  # the retrying client: a refused request comes back after retry-after, this often


def run_one(
    spec: RunSpec,
    dep: Deployment,
    trace: list[TraceRequest],
    sizing: Sizing,
    workdir: Path,
    stream_every: int,
    drain_engine_s: float,
    burst: tuple[int, int, int] | None = None,
    burst_max_model_len: int | None = None,
) -> dict[str, Any]:
    """Start the stack for one mode, replay, stop everything (always)."""
    max_model_len = burst_max_model_len if spec.burst and burst_max_model_len else dep.max_model_len
    plan = make_plan(
        trace, spec.rate, dep.max_model_len, stream_every, burst if spec.burst else None, max_model_len
    )
    ports = Ports.free()
    run_dir = workdir / f"{spec.mode}-{spec.rate:g}x-{spec.overflow}{'-burst' if spec.burst else ''}"
    run_dir = run_dir.with_name(run_dir.name + (f"-retry{spec.retries}" if spec.retries else ""))
    run_dir.mkdir(parents=True, exist_ok=True)
    sim_args = dep.sim_args(spec.time_scale, spec.overflow, max_model_len)
    kwargs: dict[str, Any] = {"ports": ports, "sim_args": sim_args, "workdir": run_dir}
    if spec.mode == "envoy":
        kwargs["with_sidecar"] = False
    elif spec.mode == "ratelimit":
        kwargs["with_sidecar"] = False
        kwargs["envoy_template"] = ratelimit_template(run_dir, sizing.requests_per_second * spec.time_scale)
    elif spec.mode == "static":
        kwargs["sidecar_config"] = sidecar_config(sizing, spec.time_scale, max_model_len)
    elif spec.mode in ("feedback", "feedback-lifetime"):
        sim_metrics = f"http://127.0.0.1:{ports.upstream}/metrics"
        booking = "lifetime" if spec.mode == "feedback-lifetime" else "forecast"
        kwargs["sidecar_config"] = sidecar_config(
            sizing, spec.time_scale, max_model_len, sim_metrics, booking
        )
    else:
        raise ValueError(spec.mode)
    stack = LocalStack(**kwargs)
    t0 = time.monotonic()
    try:
        stack.start()
        results, samples, wall = asyncio.run(
            replay(
                stack.envoy_url,
                stack.upstream_url,
                plan,
                spec.time_scale,
                drain_engine_s,
                spec.retries,
                f"{stack.admin_url}/metrics" if spec.mode.startswith("feedback") else None,
            )
        )
    finally:
        stack.stop()
    summary = summarize(results, samples, plan, spec.time_scale, wall)
    summary.update(asdict(spec))
    summary["run_wall_s"] = time.monotonic() - t0
    summary["series"] = {
        "t_engine_s": [round(s.t * spec.time_scale, 2) for s in samples],
        "kv": [round(s.kv, 4) for s in samples],
        "admitted": [s.running + s.waiting for s in samples],
        "running": [s.running for s in samples],
        "booked": [round(s.booked, 4) for s in samples],
        "scale": [round(s.scale, 4) for s in samples],
    }
    return summary
