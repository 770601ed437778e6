"""Record a protection run with a real Prometheus and plot the dashboard's main panels from their own queries.

The run is the protection benchmark's feedback mode (bench/protection: the Azure conversation trace, the
simulated Llama-3-8B on 30 % of an H100, limits sized from its KV cache) with the feed coming through the
KV exporter, in three phases: the trace at its own rate (healthy), the next slice at 4x (overloaded), then
the trace's rate again (recovery). Prometheus scrapes the sidecar, the exporter and the simulator every
second; afterwards every target of the chosen dashboard panels (k8s/monitoring/extproc-dashboard.json) is
read with the range API, variables filled in as Grafana does, and drawn into docs/img/dashboard_*.png.

    python scripts/record_dashboard_run.py      # about two minutes; needs the traces and prometheus

Absolute numbers depend on the machine (two shared cores here); the shapes are the point.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # bench/ and tests/ are not installed packages

from bench.protection import trace as tr  # noqa: E402
from bench.protection.main import STREAM_EVERY, time_scale_for  # noqa: E402
from bench.protection.run import (  # noqa: E402
    MODEL,
    Deployment,
    Plan,
    make_plan,
    replay,
    sidecar_config,
    size_limits,
)
from devstack.processes import Ports  # noqa: E402
from devstack.stack import LocalStack  # noqa: E402
from tests.monitoring.live import Prometheus, Target, dashboard_targets, substitute  # noqa: E402

# (label, trace requests, rate multiplier): healthy, overloaded, healthy again.
PHASES = (("1x", 150, 1.0), ("4x", 900, 4.0), ("1x", 150, 1.0))
GAP_ENGINE_S = 5.0
DRAIN_ENGINE_S = 40.0
VARIABLES = {"datasource": "prometheus", "pool": f"({MODEL})", "class": ".*", "__rate_interval": "5s"}
FIGURES = {
    "dashboard_admission.png": (
        "Admitted vs refused",
        "Refused by reason",
        "Active leases vs limit",
        "Tokens-per-minute remaining",
        "Decision latency",
        "Settlement outcomes",
    ),
    "dashboard_kv.png": (
        "Adaptive scale",
        "KV usage per pool",
        "KV usage per node",
        "KV budget headroom",
        "Engine queue",
        "Tokens reserved, refunded, overrun",
    ),
}


@dataclass(frozen=True)
class Phase:
    label: str
    start_engine_s: float
    end_engine_s: float


def three_phase_plan(dep: Deployment) -> tuple[Plan, list[Phase], list[tr.TraceRequest]]:
    """Consecutive slices of the conversation trace, each compressed by its phase's multiplier."""
    directory = tr.traces_dir()
    if directory is None:
        raise SystemExit(f"Azure traces not found: set ${tr.ENV_VAR}")
    full = tr.load(directory, ("conv",))
    total = sum(count for _, count, _ in PHASES)
    requests = tr.window(full, tr.TRACE_START_S, total)
    arrivals: list[tuple[float, int, int, int, bool, bool]] = []
    phases: list[Phase] = []
    offset, used = 0.0, 0
    for label, count, rate in PHASES:
        chunk = requests[used : used + count]
        base = chunk[0].t
        rebased = [tr.TraceRequest(r.t - base, r.context, r.generated, r.source) for r in chunk]
        plan = make_plan(rebased, rate, dep.max_model_len, STREAM_EVERY)
        arrivals += [(t + offset, p, w, m, s, b) for t, p, w, m, s, b in plan.arrivals]
        phases.append(Phase(label, offset, offset + plan.span_s))
        offset += plan.span_s + GAP_ENGINE_S
        used += count
    return Plan(arrivals, arrivals[-1][0]), phases, requests


def feedback_config(dep: Deployment, requests: list[tr.TraceRequest], time_scale: float) -> dict[str, Any]:
    """The benchmark's feedback mode, fed by the exporter instead of the sidecar scraping the engine."""
    config = sidecar_config(size_limits(dep, requests), time_scale, dep.max_model_len, "unused")
    config["feedback"] = {}  # LocalStack(with_exporter=True) points it at the exporter
    config["models"][MODEL] = {"context_window": dep.max_model_len}  # counted as the pool, not `other`
    return config


def legend(fmt: str, labels: dict[str, str]) -> str:
    fmt = fmt.replace(" {{instance}}", "")  # one sidecar here
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), fmt) or "value"


def query_panels(prom: Prometheus, start: float, end: float) -> dict[str, list[dict[str, Any]]]:
    """For each plotted panel: its series (legend, timestamps relative to `start`, values)."""
    wanted = {title for titles in FIGURES.values() for title in titles}
    panels: dict[str, list[dict[str, Any]]] = {title: [] for title in wanted}
    targets: list[Target] = [t for t in dashboard_targets() if t.panel in wanted]
    for target in targets:
        for series in prom.query_range(substitute(target.expr, VARIABLES), start, end, 1.0):
            panels[target.panel].append(
                {
                    "legend": legend(target.legend, series["metric"]),
                    "t": [float(ts) - start for ts, _ in series["values"]],
                    "v": [float(v) for _, v in series["values"]],
                }
            )
    return panels


def plot(
    panels: dict[str, list[dict[str, Any]]], phases: list[tuple[str, float, float]], out: Path
) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for name, titles in FIGURES.items():
        fig, axes = plt.subplots(3, 2, figsize=(13, 10), sharex=True)
        for ax, title in zip(axes.flat, titles, strict=True):
            for label, lo, hi in phases:
                if label != "1x":
                    ax.axvspan(lo, hi, color="tab:red", alpha=0.08)
            for series in panels[title]:
                ax.plot(series["t"], series["v"], label=series["legend"], linewidth=1.2)
            ax.set_title(title, fontsize=11)
            ax.grid(alpha=0.3)
            if panels[title]:
                ax.legend(fontsize=7, loc="upper left")
        for ax in axes[-1]:
            ax.set_xlabel("wall seconds (shaded: trace at 4x its rate)")
        fig.suptitle("extproc dashboard over a protection run: healthy (1x), overloaded (4x), healthy (1x)")
        fig.tight_layout()
        path = out / name
        fig.savefig(path, dpi=90)
        plt.close(fig)
        written.append(path)
    return written


def summarize(prom: Prometheus, end: float) -> dict[str, Any]:
    """Totals of the run, for the text in docs/monitoring.md."""

    def by(expr: str, label: str) -> dict[str, float]:
        return {s["metric"].get(label, ""): round(float(s["value"][1]), 3) for s in prom.query(expr, at=end)}

    return {
        "decisions": by("sum by (decision) (extproc_requests_total)", "decision"),
        "refused_by_reason": by('sum by (reason) (extproc_requests_total{decision="rejected"})', "reason"),
        "settlements": by("sum by (outcome) (extproc_settlements_total)", "outcome"),
        "min_scale": by("min_over_time(extproc_adaptive_scale_ratio[10m])", "pool"),
        "kv_usage_peak": by("max_over_time(extproc_kv_usage_ratio[10m])", "pool"),
        "engine_preemptions": by("sum(vllm:num_preemptions_total)", ""),
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "img")
    args = parser.parse_args()
    dep = Deployment()
    plan, phases, requests = three_phase_plan(dep)
    time_scale = time_scale_for(len(requests) / requests[-1].t, 4.0)
    workdir = Path(tempfile.mkdtemp(prefix="dashboard-run-"))
    ports = Ports.free()
    stack = LocalStack(
        ports=ports,
        sidecar_config=feedback_config(dep, requests, time_scale),
        sim_args=dep.sim_args(time_scale, "preempt"),
        with_exporter=True,
        workdir=workdir / "stack",
    )
    jobs = {
        "extproc-gateway": f"127.0.0.1:{ports.admin}",
        "extproc-kv-exporter": f"127.0.0.1:{ports.exporter_metrics}",
        "simulator": f"127.0.0.1:{ports.upstream}",
    }
    prom = Prometheus(workdir / "prometheus", jobs)
    try:
        stack.start()
        prom.start()
        prom.wait_scraped(len(jobs))
        # The feed turns fresh and the limits recover to full before the first arrival.
        prom.wait_for(f'extproc_adaptive_scale_ratio{{pool="{MODEL}"}} == 1', timeout_s=60)
        start = time.time()
        results, _, wall = asyncio.run(
            replay(stack.envoy_url, stack.upstream_url, plan, time_scale, DRAIN_ENGINE_S)
        )
        time.sleep(3)
        end = time.time()
        panels = query_panels(prom, start, end)
        summary = summarize(prom, end)
    finally:
        prom.stop()
        stack.stop()
    # replay() sends the first request 0.5 s after it starts; engine seconds / time scale = wall seconds.
    wall_phases = [
        (p.label, 0.5 + p.start_engine_s / time_scale, 0.5 + p.end_engine_s / time_scale) for p in phases
    ]
    written = plot(panels, wall_phases, args.out)
    outcomes = {k: sum(1 for r in results if r.outcome == k) for k in ("ok", "rejected", "error", "timeout")}
    statuses = Counter(str(r.status) for r in results)
    report = {
        "time_scale": round(time_scale, 3),
        "wall_s": round(wall, 1),
        "phases_wall_s": [(label, round(lo, 1), round(hi, 1)) for label, lo, hi in wall_phases],
        "client_outcomes": outcomes,
        "client_statuses": dict(sorted(statuses.items())),
        **summary,
    }
    print(json.dumps(report, indent=1))
    for path in written:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
