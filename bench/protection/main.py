"""The protection matrix: modes x arrival-rate multipliers x overflow behaviour, plus a long-context burst."""

from __future__ import annotations

import json
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import RESULTS, write_json
from bench.protection import trace as tr
from bench.protection.run import MODES, Deployment, RunSpec, run_one, size_limits

WALL_REQUEST_RATE = 40.0  # requests per wall second the load generator aims at (sets the time scale)
MAX_TIME_SCALE = 20.0
DRAIN_ENGINE_S = 60.0  # after the last arrival, engine seconds requests may still take before being cut
STREAM_EVERY = 4  # every 4th request is streamed: TTFT is measured on those, e2e on all
BURST = (10, 7500, 300)  # ten 7.5k-token prompts generating 300 tokens each, at the slice's midpoint
BURST_RATE = 2.0
RETRIES = 3  # the retrying client: a refused request comes back after retry-after, at most 3 times
CODE_RATE = 4.0


def time_scale_for(slice_rate: float, rate: float) -> float:
    """Compress time so the wall request rate stays ~WALL_REQUEST_RATE whatever the multiplier."""
    return max(1.0, min(MAX_TIME_SCALE, WALL_REQUEST_RATE / (slice_rate * rate)))


def _downsample(series: dict[str, list[float]], points: int = 300) -> dict[str, list[float]]:
    n = len(series["t_engine_s"])
    step = max(1, math.ceil(n / points))
    return {k: v[::step] for k, v in series.items()}


def run(short: bool, modes: tuple[str, ...] = MODES, only_bursts: bool = False) -> dict[str, Any] | None:
    """The matrix (short: 4x preempt only). `only_bursts`: re-run the burst scenario alone and replace its
    rows in an existing full result file."""
    directory = tr.traces_dir()
    if directory is None:
        print(
            f"protection: Azure traces not found (set ${tr.ENV_VAR} or use ../shared/traces); skipped",
            file=sys.stderr,
        )
        return None
    dep = Deployment()
    full_trace = tr.load(directory, ("conv",))
    count = 400 if short else 1200
    trace = tr.window(full_trace, tr.TRACE_START_S, count)
    slice_rate = len(trace) / trace[-1].t
    sizing = size_limits(dep, trace)
    rates = (4.0,) if short else (1.0, 2.0, 4.0)
    overflows = ("preempt",) if short else ("preempt", "oom")
    run_modes = tuple(m for m in modes if not (short and m == "ratelimit"))
    specs = [
        RunSpec(mode, rate, overflow, time_scale_for(slice_rate, rate))
        for overflow in overflows
        for rate in rates
        for mode in run_modes
    ]
    # The retrying client at 4x, for every mode that refuses (Envoy alone never answers 429).
    specs += [
        RunSpec(mode, 4.0, "preempt", time_scale_for(slice_rate, 4.0), retries=RETRIES)
        for mode in run_modes
        if mode != "envoy"
    ]
    code_trace = tr.window(tr.load(directory, ("code",)), tr.TRACE_START_S, count)
    code_rate = len(code_trace) / code_trace[-1].t
    if not short:
        specs += [
            RunSpec(mode, BURST_RATE, overflow, time_scale_for(slice_rate, BURST_RATE), burst=True)
            for overflow in overflows
            for mode in run_modes
        ]
        # The coding service's trace on the same deployment and limits: long prompts, short answers.
        specs += [
            RunSpec(mode, CODE_RATE, "preempt", time_scale_for(code_rate, CODE_RATE), extra={"trace": "code"})
            for mode in run_modes
        ]
    if only_bursts:
        specs = [s for s in specs if s.burst]
    workdir = Path(tempfile.mkdtemp(prefix="bench-protection-"))
    runs = []
    t0 = time.monotonic()
    for spec in specs:
        print(
            f"protection: {spec.mode} {spec.rate:g}x {spec.overflow}{' burst' if spec.burst else ''}"
            f"{f' retry {spec.retries}' if spec.retries else ''} (time scale {spec.time_scale:.2f})",
            flush=True,
        )
        replayed = code_trace if spec.extra.get("trace") == "code" else trace
        summary = run_one(spec, dep, replayed, sizing, workdir, STREAM_EVERY, DRAIN_ENGINE_S, BURST)
        summary["trace"] = spec.extra.get("trace", "conv")
        summary["series"] = _downsample(summary["series"])
        print(
            "  ok {ok} rejected {rejected} errors {error} timeouts {timeout} preemptions {preemptions:g} "
            "oom {oom_events:g} goodput {goodput_tok_s:.0f} tok/s (SLO {slo_goodput_tok_s:.0f}) "
            "TTFT p99 {ttft_p99_s:.2f} s kv mean {kv_mean_overload:.2f} peak {kv_peak:.2f} "
            "reasons {reject_reasons} ({run_wall_s:.0f} s)".format(**summary),
            flush=True,
        )
        runs.append(summary)
    result = {
        "deployment": {
            **{k: getattr(dep, k) for k in dep.__dataclass_fields__},
            "num_gpu_blocks": dep.num_gpu_blocks,
            "kv_tokens": dep.kv_tokens,
        },
        "sizing": sizing.__dict__,
        "trace": {
            "files": list(tr.TRACE_FILES.values()),
            "start_s": tr.TRACE_START_S,
            "requests": len(trace),
            "rate_req_s": slice_rate,
            "span_s": trace[-1].t,
            "code_rate_req_s": code_rate,
            "code_span_s": code_trace[-1].t,
        },
        "stream_every": STREAM_EVERY,
        "drain_engine_s": DRAIN_ENGINE_S,
        "burst": {"count": BURST[0], "prompt": BURST[1], "output": BURST[2], "rate": BURST_RATE},
        "short": short,
        "duration_s": time.monotonic() - t0,
        "runs": runs,
    }
    if only_bursts:
        previous = json.loads((RESULTS / "protection.json").read_text())
        previous["runs"] = [r for r in previous["runs"] if not r["burst"]] + runs
        previous["bursts_rerun_duration_s"] = result["duration_s"]
        result = previous
    write_json(f"protection{'-short' if short else ''}.json", result)
    # The same modes on engine time alone (seconds, deterministic): what the policies do without the machine.
    from bench.protection import offline

    offline.main([] if short else ["--full"])
    try:
        plot(result, RESULTS)
    except ImportError as exc:  # matplotlib is a dev extra
        print(f"protection: no plots ({exc})", file=sys.stderr)
    return result


COLORS = {
    "envoy": "tab:red",
    "ratelimit": "tab:orange",
    "static": "tab:blue",
    "feedback-lifetime": "tab:olive",
    "feedback": "tab:green",
}


def plot(result: dict[str, Any], out: Path) -> list[Path]:
    """KV usage and admitted concurrency over engine time, one figure per (rate, overflow, burst)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups: dict[tuple[str, float, str, bool], list[dict[str, Any]]] = {}
    for r in result["runs"]:
        groups.setdefault((r.get("trace", "conv"), r["rate"], r["overflow"], r["burst"]), []).append(r)
    paths = []
    suffix = "-short" if result["short"] else ""
    for (trace, rate, overflow, burst), runs in sorted(groups.items()):
        runs = [r for r in runs if not r.get("retries")]
        fig, (ax_kv, ax_c) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
        for r in runs:
            s = r["series"]
            color = COLORS.get(r["mode"])
            ax_kv.plot(s["t_engine_s"], s["kv"], label=r["mode"], color=color, lw=1)
            ax_c.plot(s["t_engine_s"], s["admitted"], label=r["mode"], color=color, lw=1)
        ax_kv.axhline(1.0, color="black", lw=0.5, ls=":")
        ax_kv.set_ylabel("KV cache usage")
        ax_kv.set_ylim(0, 1.05)
        ax_c.set_ylabel("requests at the engine\n(running + waiting)")
        ax_c.set_xlabel("engine seconds")
        title = f"Azure {trace} trace at {rate:g}x, overflow={overflow}"
        if burst:
            title += f", + {result['burst']['count']} x {result['burst']['prompt']}-token burst at mid-slice"
        ax_kv.set_title(title)
        ax_kv.legend(loc="upper right", fontsize=8)
        fig.tight_layout()
        name = f"protection_{trace}_{rate:g}x_{overflow}{'_burst' if burst else ''}{suffix}.png"
        path = out / name
        fig.savefig(path, dpi=80)
        plt.close(fig)
        paths.append(path)
    return paths


if __name__ == "__main__":
    # `python -m bench.protection.main --bursts`: only the long-context burst rows of the full run.
    run(short=False, only_bursts="--bursts" in sys.argv)
