"""Gateway replicas sharing one pool's KV cache (issue 39): `python -m bench.fleet [--seconds S]`.

One simulator with a 16,384-token cache (1,024 blocks of 16, `make run`'s; its default step cost), one
redis-server, and one or two gateways, each a real Envoy and its sidecar (lean profile), built with
tests/support/fleet.py. Every sidecar runs k8s/gateway/config.yaml with its slot and TPM limits raised so
the KV budget binds, `kv_budget.capacity_share: 1.0` (the shipped value), its store on the Redis (a 1 s
call bound, `STORE_TIMEOUT_MS`) and its KV feed scraping the simulator's page (`feedback.direct_targets`,
every second, as the exporter publishes). Two variants: `shipped` (its interactive class queues a request
the KV budget cannot take now for up to 25 s) and `no-queue` (its classes removed: refused at once, with a
forecast `retry-after`, as the config issue 39 measured).

The load: 30 closed-loop clients, each streaming one chat at a time of 1,000-1,500 prompt tokens (uniform,
seeded; no two prompts share a prefix) and 300 output tokens, honouring `retry-after` on a 429, for
`--seconds`; the answers in flight then end. Rows, per variant: one gateway (every client on it), and two
gateways with the clients split 100/0, 90/10 and 50/50. Each row starts a fresh fleet and waits until every
sidecar is fed, knows the other, and its adaptive scale is back at 1.

Per row: output tokens/s (the engine's generated tokens over the load's window), its ratio to the one-gateway
row, KV usage mean and peak and preemptions (the simulator's own series, sampled every 50 ms), refusals by
reason, and the most the engine ran beyond the slots the fleet held (the slot leases in Redis, read around
each engine sample: tests/support/fleet.py `Sample`), which must stay <= 0, and beyond the requests it held
admitted. Results: bench/results/fleet-sim.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

import yaml

from bench.common import fmt, md_table, write_json
from devstack.run import LOCAL_SIM_ARGS
from extproc.envoyconf.profiles import REPO
from tests.support.fleet import (
    MODEL,
    Fleet,
    Load,
    Sample,
    Sampler,
    drive,
    running_over_admitted,
    running_over_held,
    split,
)
from tests.support.stack import metric, scrape

SHIPPED = REPO / "k8s" / "gateway" / "config.yaml"
CLIENTS = 30
SEED = 39
ROWS: dict[str, tuple[int, ...]] = {
    "one": (100,),
    "100/0": (100, 0),
    "90/10": (90, 10),
    "50/50": (50, 50),
}
"""Row name: the share of the clients (percent) on each gateway; one entry per gateway."""
RAISED = 1_000_000_000
"""Slots and tokens per minute no load here reaches: the KV budget decides."""
SIDECAR_COUNTERS = (
    "extproc_store_fallback_acquires_total",
    "extproc_slots_released_early_total",
    "extproc_store_lost_leases_total",
)
"""Read at each row's end: admissions beside the store (their leases are not in Redis, so the sampled
invariant does not see them), slots given back before their request ended, leases Redis lost."""
FLEET_SERIES = (
    "extproc_kv_budget_tokens",
    "extproc_kv_booked_tokens",
    "extproc_kv_peers_booked_tokens",
    "extproc_kv_unexplained_tokens",
    "extproc_kv_peers_known",
)


STORE_TIMEOUT_MS = 1000
"""`store.redis.timeout_ms` (shipped: 50). On a shared 2-core host at load 5-8 the shipped bound sent up to 18
admissions a row to the local fallback, whose leases Redis does not hold, so the sampled invariant counted
them as running without a slot; a second keeps every lease in Redis."""


def config(variant: str) -> dict[str, Any]:
    """The shipped gateway config with its slot and TPM limits raised so the KV budget binds. `no-queue`:
    without its classes, so a request the KV budget cannot take is refused at once (the shipped config
    before issue 41, the one issue 39 measured)."""
    shipped: dict[str, Any] = yaml.safe_load(SHIPPED.read_text())
    limits = shipped["limits"]
    limits["global"] = {**limits.get("global", {}), "max_concurrency": 512}
    limits["models"][MODEL] = {"max_concurrency": 512, "tokens_per_minute": RAISED}
    limits["tenant_default"] = {"tokens_per_minute": RAISED}
    shipped["kv_budget"]["capacity_share"] = 1.0
    shipped["store"]["redis"]["timeout_ms"] = STORE_TIMEOUT_MS
    if variant == "no-queue":
        shipped.pop("classes", None)
        shipped.pop("default_class", None)
    return shipped


VARIANTS = ("shipped", "no-queue")


class SidecarPoller(threading.Thread):
    """Each sidecar's KV-budget series of the pool, once a second (what each gateway booked, and saw)."""

    def __init__(self, admin_urls: list[str]) -> None:
        super().__init__(daemon=True, name="sidecar-poller")
        self.urls = [f"{url}/metrics" for url in admin_urls]
        self.polls: list[dict[str, list[float]]] = [{s: [] for s in FLEET_SERIES} for _ in self.urls]
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.wait(1.0):
            for url, polls in zip(self.urls, self.polls, strict=True):
                try:
                    page = scrape(url)
                except OSError:
                    continue
                for series in FLEET_SERIES:
                    value = page.get((series, (("pool", MODEL),)))
                    if value is not None:
                        polls[series].append(value)

    def stop(self) -> None:
        self._stop_event.set()
        self.join(10)


@dataclass
class Window:
    """The samples taken while the clients were sending, and the engine's tokens over them."""

    samples: list[Sample]
    tok_s: float
    seconds: float


def window(samples: list[Sample], start: float, seconds: float) -> Window:
    inside = [s for s in samples if start <= s.at <= start + seconds]
    if len(inside) < 2:
        return Window(inside, float("nan"), 0.0)
    span = inside[-1].at - inside[0].at
    return Window(inside, (inside[-1].generated - inside[0].generated) / span, span)


def run_row(name: str, shares: tuple[int, ...], seconds: float, settings: dict[str, Any]) -> dict[str, Any]:
    load = Load(gateway_of=split(CLIENTS, shares), seconds=seconds, seed=SEED)
    with Fleet(settings, gateways=len(shares)) as fleet:
        fleet.wait_fed(60)
        assert fleet.redis is not None
        poller = SidecarPoller(fleet.admin_urls)
        poller.start()
        try:
            with Sampler(fleet.sim_url, fleet.redis.url) as sampler:
                tally = drive(fleet.urls, load)
        finally:
            poller.stop()
        counters = [
            {name: metric(f"{url}/metrics", name) for name in SIDECAR_COUNTERS} for url in fleet.admin_urls
        ]
    samples = sampler.samples
    inside = window(samples, tally.started, seconds)
    kv = [s.kv for s in inside.samples]
    return {
        "row": name,
        "gateways": len(shares),
        "clients": [load.gateway_of.count(i) for i in range(len(shares))],
        "output_tok_s": round(inside.tok_s, 1),
        "window_s": round(inside.seconds, 1),
        "kv_mean": round(statistics.fmean(kv), 3) if kv else None,
        "kv_peak": round(max(kv), 3) if kv else None,
        "preemptions": samples[-1].preemptions - samples[0].preemptions if samples else None,
        "refusals": sum(tally.refused),
        "refusals_by_reason": tally.reasons,
        "refusals_per_gateway": tally.refused,
        "answered": tally.answered,
        "client_output_tokens": tally.output_tokens,
        "errors": tally.errors,
        "error_statuses": tally.statuses,
        "running_over_held_max": running_over_held(samples),
        "running_over_admitted_max": running_over_admitted(samples),
        "running_mean": round(statistics.fmean(s.running for s in inside.samples), 2) if kv else None,
        "waiting_max": max((s.waiting for s in samples), default=None),
        "samples": len(samples),
        "samples_failed": sampler.failed,
        "sample_span_max_s": round(max((s.span_s for s in samples), default=0.0), 3),
        "samples_over": [asdict(s) for s in samples if s.running > s.held][:10],
        "sidecar_counters": counters,
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        "sidecars": [
            {
                series: {
                    "mean": round(statistics.fmean(values), 1) if values else None,
                    "min": min(values, default=None),
                    "max": max(values, default=None),
                }
                for series, values in polls.items()
            }
            for polls in poller.polls
        ],
    }


def table(rows: list[dict[str, Any]]) -> str:
    base = next((r["output_tok_s"] for r in rows if r["row"] == "one"), None)
    header = (
        "config",
        "row",
        "clients per gateway",
        "output tok/s",
        "vs one gateway",
        "KV mean",
        "KV peak",
        "preemptions",
        "refusals",
        "max(running - held slots)",
        "max(running - admitted)",
    )
    lines = []
    for r in rows:
        ratio = f"{100 * r['output_tok_s'] / base:.0f} %" if base else "-"
        lines.append(
            (
                r["variant"],
                "one gateway" if r["row"] == "one" else f"two gateways, {r['row']}",
                " / ".join(str(c) for c in r["clients"]),
                fmt(r["output_tok_s"], 0),
                ratio,
                fmt(r["kv_mean"], 2),
                fmt(r["kv_peak"], 2),
                fmt(r["preemptions"], 0),
                r["refusals"],
                fmt(r["running_over_held_max"], 0),
                fmt(r["running_over_admitted_max"], 0),
            )
        )
    return md_table(header, lines)


def commit() -> str:
    """The commit measured, `-dirty` when the working tree differed from it."""
    out = subprocess.run(
        ["git", "describe", "--always", "--dirty"], cwd=REPO, capture_output=True, text=True, timeout=30
    )
    return out.stdout.strip() or "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.fleet", description=__doc__)
    parser.add_argument("--seconds", type=float, default=60.0, help="how long the clients send, per row")
    parser.add_argument("--rows", default=",".join(ROWS), help="comma-separated: " + ",".join(ROWS))
    parser.add_argument(
        "--variants", default=",".join(VARIANTS), help="comma-separated: " + ",".join(VARIANTS)
    )
    args = parser.parse_args(argv)
    names = [r.strip() for r in args.rows.split(",") if r.strip()]
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = (set(names) - set(ROWS)) | (set(variants) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown row(s) or variant(s): {', '.join(sorted(unknown))}")
    # Read once: the shipped file may change while the rows run (it did, once).
    settings = {variant: config(variant) for variant in variants}
    rows = []
    started = time.monotonic()
    for variant in variants:
        for name in names:
            t0 = time.monotonic()
            row = {"variant": variant, **run_row(name, ROWS[name], args.seconds, settings[variant])}
            row["row_wall_s"] = round(time.monotonic() - t0, 1)
            print(f"fleet {variant} {name}: {row}", flush=True)
            rows.append(row)
    for variant in variants:
        print(table([r for r in rows if r["variant"] == variant]), flush=True)
    write_json(
        "fleet-sim.json",
        {
            "engine": f"extproc.sim {' '.join(LOCAL_SIM_ARGS)} (16,384 tokens), default step cost",
            "config": "k8s/gateway/config.yaml, slots and TPM raised, kv_budget.capacity_share 1.0, "
            f"store on one redis-server (timeout_ms {STORE_TIMEOUT_MS}), feedback.direct_targets at the "
            "simulator; lean profile. no-queue: without its classes",
            "settings": settings,
            "load": {
                "clients": CLIENTS,
                "prompt_tokens": list(Load.prompt_tokens),
                "output_tokens": Load.output_tokens,
                "seconds": args.seconds,
                "seed": SEED,
                "retry": "honours retry-after-ms / retry-after",
            },
            "rows": rows,
            "wall_s": round(time.monotonic() - started, 1),
            "commit": commit(),
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
