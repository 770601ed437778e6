"""Markdown tables from the raw results: `python -m bench.report [--short]` prints what RESULTS.md quotes."""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

from bench.common import RESULTS, fmt, md_table
from bench.overhead.profiles import tables as profile_tables


def _load(name: str) -> Any:
    path = RESULTS / name
    return json.loads(path.read_text()) if path.is_file() else None


def _run_label(r: dict[str, Any]) -> str:
    label = f"{r.get('trace', 'conv')} {r['rate']:g}x" + (" + burst" if r["burst"] else "")
    return label + (f" + retry {r['retries']}" if r.get("retries") else "")


def protection_tables(data: dict[str, Any]) -> str:
    rows = []
    for r in data["runs"]:
        rows.append(
            [
                r["overflow"],
                _run_label(r),
                r["mode"],
                f"{r['preemptions']:g}",
                f"{r['oom_events']:g}",
                fmt(r["goodput_tok_s"], 0),
                fmt(r.get("slo_goodput_tok_s", math.nan), 0),
                f"{100 * r['rejection_rate']:.1f} %",
                f"{100 * r['failure_rate']:.1f} %",
                fmt(r["ttft_p50_s"], 2),
                fmt(r["ttft_p99_s"], 2),
                fmt(r["e2e_p50_s"], 2),
                fmt(r["e2e_p99_s"], 2),
                fmt(r["kv_peak"], 2),
                fmt(r["kv_mean"], 2),
                fmt(r.get("kv_mean_overload", math.nan), 2),
            ]
        )
    header = [
        "overflow",
        "trace, rate",
        "mode",
        "preemptions",
        "OOM",
        "goodput tok/s",
        "SLO goodput tok/s",
        "rejected",
        "failed",
        "TTFT p50 s",
        "TTFT p99 s",
        "e2e p50 s",
        "e2e p99 s",
        "KV peak",
        "KV mean",
        "KV mean overload",
    ]
    out = [md_table(header, rows)]
    bursts = [r for r in data["runs"] if r["burst"] and "burst_outcome" in r]
    if bursts:
        out.append("")
        out.append(
            md_table(
                ["overflow", "mode", "burst admitted+completed", "burst rejected", "burst failed"],
                [
                    [
                        r["overflow"],
                        r["mode"],
                        r["burst_outcome"]["ok"],
                        r["burst_outcome"]["rejected"],
                        r["burst_outcome"]["error"] + r["burst_outcome"]["timeout"],
                    ]
                    for r in bursts
                ],
            )
        )
    refusing = [r for r in data["runs"] if r.get("reject_reasons") and r["rate"] == 4.0 and not r["burst"]]
    if refusing:
        out.append("")
        out.append(
            md_table(
                ["overflow", "trace, rate", "mode", "requests sent", "refused at last", "refusals by reason"],
                [
                    [
                        r["overflow"],
                        _run_label(r),
                        r["mode"],
                        r.get("attempts", r["requests"]),
                        r["rejected"],
                        ", ".join(f"{k} {v}" for k, v in r["reject_reasons"].items()),
                    ]
                    for r in refusing
                ],
            )
        )
    return "\n".join(out)


def offline_table(data: dict[str, Any]) -> str:
    """The modes and their bounds on engine time alone (`bench.protection.offline`)."""
    rows = [
        [
            f"{r['rate']:g}x",
            r["scenario"] + (f", retry {r['retries']}" if r["retries"] else ""),
            f"{r['admitted']} / {r['requests']}",
            r["preemptions"],
            fmt(r["goodput_tok_s"], 0),
            fmt(r["slo_goodput_tok_s"], 0),
            fmt(r["ttft_p50_s"], 2),
            fmt(r["ttft_p99_s"], 2),
            fmt(r["kv_mean_overload"], 2),
            fmt(r["kv_peak"], 2),
            f"{fmt(r['engine_busy_s'], 1)} ({fmt(r['prefill_s'], 1)})",
        ]
        for r in data["rows"]
    ]
    header = [
        "conv, preempt",
        "scenario",
        "admitted",
        "preemptions",
        "goodput tok/s",
        "SLO goodput tok/s",
        "TTFT p50 s",
        "TTFT p99 s",
        "KV mean overload",
        "KV peak",
        "engine busy s (prefill)",
    ]
    return md_table(header, rows)


def _added(mode: dict[str, Any], base: dict[str, Any], key: str, pct: str) -> float:
    a, b = mode.get(key, {}).get(pct), base.get(key, {}).get(pct)
    return a - b if a is not None and b is not None else math.nan


def overhead_tables(data: dict[str, Any]) -> str:
    modes = {m["mode"]: m for m in data["modes"]}
    base = modes["envoy"]
    lines = []
    rows = []
    for size in (1024, 4096, 32768):
        key = f"prompt_{size}"
        if key not in base:
            continue
        for name in ("noop", "sidecar"):
            m = modes[name][key]
            b = base[key]
            cpu = m["open_loop"]["cpu_s"].get("processor", math.nan)
            per_k = cpu / max(1, m["open_loop"]["n"]) * 1000
            rows.append(
                [
                    f"{size // 1024}k",
                    name,
                    fmt(m["sequential"]["p50_ms"] - b["sequential"]["p50_ms"], 2),
                    fmt(m["sequential"]["p99_ms"] - b["sequential"]["p99_ms"], 2),
                    f"{m['open_loop']['rate']:g}/s",
                    fmt(m["open_loop"]["p50_ms"] - b["open_loop"]["p50_ms"], 2),
                    fmt(m["open_loop"]["p99_ms"] - b["open_loop"]["p99_ms"], 2),
                    fmt(per_k, 2),
                    fmt(1000 / per_k if per_k else math.nan, 0),
                ]
            )
    lines.append(
        md_table(
            [
                "prompt",
                "processor",
                "seq added p50 ms",
                "seq added p99 ms",
                "open-loop rate",
                "added p50 ms",
                "added p99 ms",
                "processor CPU s / 1k req",
                "req per CPU-s",
            ],
            rows,
        )
    )
    lines.append("")
    base_rows = []
    for name in ("envoy", "noop", "sidecar"):
        for size in (1024, 4096, 32768):
            m = modes[name].get(f"prompt_{size}")
            if m is None:
                continue
            base_rows.append(
                [
                    name,
                    f"{size // 1024}k",
                    fmt(m["sequential"]["p50_ms"], 2),
                    fmt(m["sequential"]["p99_ms"], 2),
                    fmt(m["open_loop"]["p50_ms"], 2),
                    fmt(m["open_loop"]["p99_ms"], 2),
                    m["open_loop"]["errors"],
                ]
            )
    lines.append(
        md_table(
            ["path", "prompt", "seq p50 ms", "seq p99 ms", "open p50 ms", "open p99 ms", "errors"], base_rows
        )
    )
    lines.append("")
    ladder_rows = []
    for name in ("envoy", "noop", "sidecar"):
        for step in modes[name]["ladder_1k"]:
            cpu = step["cpu_s"].get("processor")
            ladder_rows.append(
                [
                    name,
                    f"{step['rate']:g}",
                    fmt(step["p50_ms"], 1),
                    fmt(step["p99_ms"], 1),
                    step["errors"],
                    "yes" if step["sustained"] else "no",
                    fmt(cpu / step["n"] * 1e6, 0) if cpu is not None else "-",
                    fmt(step["cpu_s"].get("envoy", math.nan) / step["n"] * 1e6, 0),
                ]
            )
    lines.append(
        md_table(
            [
                "path",
                "offered req/s",
                "p50 ms",
                "p99 ms",
                "errors",
                "sustained",
                "processor µs CPU/req",
                "Envoy µs CPU/req",
            ],
            ladder_rows,
        )
    )
    lines.append("")
    chunks = data["stream_chunks"] + 2  # + usage chunk + [DONE]
    s_rows = []
    for name in ("envoy", "noop", "sidecar"):
        m = modes[name]
        seq = m["stream_sequential"]
        plain = m["prompt_1024"]["sequential_cpu_s"].get("processor", 0.0) / m["prompt_1024"]["sequential_n"]
        cpu = seq["cpu_s"].get("processor")
        per_chunk = (cpu / seq["n"] - plain) / chunks * 1e6 if cpu is not None else math.nan
        s_rows.append(
            [
                name,
                fmt(seq["p50_ms"], 1),
                fmt(seq.get("chunk_gap_p50_ms"), 2),
                fmt(seq.get("chunk_gap_p99_ms"), 2),
                fmt(m["stream_open_loop"].get("chunk_gap_p99_ms"), 2),
                fmt(per_chunk, 1),
            ]
        )
    lines.append(
        md_table(
            [
                "path",
                "streamed request p50 ms",
                "chunk gap p50 ms (seq)",
                "chunk gap p99 ms (seq)",
                "chunk gap p99 ms (20 streams/s)",
                "processor CPU µs per chunk",
            ],
            s_rows,
        )
    )
    lines.append("")
    a_rows = []
    for name in ("envoy", "noop", "sidecar"):
        m = modes[name]
        a_rows.append(
            [
                name,
                fmt(m["adversarial_baseline"]["p50_ms"], 1),
                fmt(m["adversarial_baseline"]["p99_ms"], 1),
                fmt(m["adversarial"]["p50_ms"], 1),
                fmt(m["adversarial"]["p99_ms"], 1),
                fmt(m["adversarial"]["big"]["p50_ms"], 1),
                fmt(m["adversarial_baseline"].get("loop_lag_p99_ms"), 2),
                fmt(m["adversarial"].get("loop_lag_p99_ms"), 2),
                fmt(m["adversarial"].get("loop_lag_max_ms"), 2),
                m["adversarial"]["errors"] + m["adversarial"]["big"]["errors"],
            ]
        )
    lines.append(
        md_table(
            [
                "path",
                "small p50 ms alone",
                "small p99 ms alone",
                "small p50 ms + 500 KB bodies",
                "small p99 ms + 500 KB bodies",
                "500 KB body p50 ms",
                "loop lag p99 ms alone",
                "loop lag p99 ms + 500 KB",
                "loop lag max ms + 500 KB",
                "errors",
            ],
            a_rows,
        )
    )
    lines.append("")
    b_rows = []
    for row in data["body_modes"]:
        cpu = row["cpu_s"].get("processor", math.nan)
        b_rows.append(
            [
                row["mode"],
                row["body_mode"],
                fmt(row["p50_ms"], 1),
                fmt(row["p99_ms"], 1),
                fmt(cpu / row["n"] * 1000, 2),
                fmt(row["cpu_s"].get("envoy", math.nan) / row["n"] * 1000, 2),
            ]
        )
    lines.append(
        md_table(
            ["processor", "response body", "p50 ms", "p99 ms", "processor CPU ms/req", "Envoy CPU ms/req"],
            b_rows,
        )
    )
    return "\n".join(lines)


def micro_table(data: dict[str, Any]) -> str:
    rows = [
        [b["name"], fmt(b["stats"]["min"] * 1e6, 1), fmt(b["stats"]["median"] * 1e6, 1), b["stats"]["rounds"]]
        for b in sorted(data["benchmarks"], key=lambda b: b["stats"]["median"])
    ]
    return md_table(["benchmark", "min µs", "median µs", "rounds"], rows)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--short", action="store_true")
    args = parser.parse_args()
    sfx = "-short" if args.short else ""
    for title, name, render in (
        ("Protection", f"protection{sfx}.json", protection_tables),
        ("Protection, engine time only", f"protection-offline{sfx}.json", offline_table),
        ("Overhead", f"overhead{sfx}.json", overhead_tables),
        ("Overhead of both profiles", f"overhead-profiles{sfx}.json", profile_tables),
        ("Micro", f"micro{sfx}.json", micro_table),
    ):
        data = _load(name)
        if data is not None:
            print(f"## {title}\n\n{render(data)}\n")


if __name__ == "__main__":
    main()
