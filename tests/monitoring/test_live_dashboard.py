"""Every dashboard query returns data from a real Prometheus scraping the live local stack.

The stack (simulator, KV exporter, sidecar, real Envoy) runs a config that exercises every panel: limits
with a class guarantee, a queueing class and one that does not queue, KV feedback and the KV budget. The
traffic produces admissions, settlements with refunds, and refusals for concurrency, queue_full,
queue_timeout, kv_budget and invalid JSON, then one refusal by the engine itself (its queue, bounded like
vLLM's --max-num-queued-reqs, filled straight). Prometheus (Debian's 2.42) scrapes the sidecar, the exporter
and the simulator every second and evaluates the PrometheusRule. Then each dashboard target, with its
variables filled in as Grafana would, must return a series with at least one value over the run, and every
alert rule must evaluate without error.

Store errors: the panel's series (`extproc_store_*`) are exported from the first scrape, zeros for a
healthy store, so they are asserted here without a Redis; the alerts on them have promtool unit tests.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from devstack.stack import LocalStack
from tests.monitoring.live import (
    Prometheus,
    dashboard_targets,
    substitute,
)
from tests.monitoring.promtool import rule_groups
from tests.support.stack import fixed_step_sim, metric, start_stack

pytestmark = pytest.mark.e2e

MODEL = "llama-3-8b"
CONFIG: dict[str, Any] = {
    "admission": {"tenant": {"header": "x-tenant-id"}},
    # The pool named under `models`: requests are counted under its name, not `other`.
    "models": {"*": {"context_window": 2048, "default_max_tokens": 64}, MODEL: {}},
    "classes": [
        {"name": "critical", "queue": {"max_wait_seconds": 1.0, "max_queued": 2}},
        {"name": "batch"},
    ],
    "default_class": "batch",
    "tenants": {"chat": {"class": "critical"}},
    "metrics": {"tenant_allowlist": ["chat"]},
    "limits": {
        "models": {
            MODEL: {
                "max_concurrency": 4,
                "tokens_per_minute": 200_000,
                "guaranteed": {"critical": {"max_concurrency": 2}},
            }
        }
    },
    "adaptive": {"min_scale": 0.5, "recovery_per_second": 1.0, "stale_after_seconds": 3.0},
    "kv_budget": {"enabled": True, "target_utilization": 0.9},
}
# 128 blocks of 16 tokens = 2,048 KV tokens (budget 1,843). A decode step takes 20 ms: 200 tokens = 4 s.
# The engine's queue holds 5 requests, one more than the gateway ever forwards at once (its 4 slots): only
# the refusal phase, which fills it straight, meets the bound.
ENGINE_QUEUE = 5
SIM_ARGS = fixed_step_sim(
    MODEL,
    20,
    "--num-gpu-blocks",
    "128",
    "--max-model-len",
    "2048",
    "--max-num-queued-reqs",
    str(ENGINE_QUEUE),
)
ROUNDS = 2
VARIABLES = {
    "datasource": "prometheus",
    "pool": f"({MODEL})",
    "class": "(critical|batch)",
    "__rate_interval": "10s",
}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    workdir = tmp_path_factory.mktemp("stack")
    local = start_stack(
        config=CONFIG,
        sim_args=SIM_ARGS,
        with_exporter=True,
        workdir=workdir,
    )
    try:
        yield local
    finally:
        local.stop()


@pytest.fixture(scope="module")
def prometheus(stack: LocalStack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prometheus]:
    ports = stack.ports
    jobs = {
        "extproc-gateway": f"127.0.0.1:{ports.admin}",
        "extproc-kv-exporter": f"127.0.0.1:{ports.exporter_metrics}",
        "simulator": f"127.0.0.1:{ports.upstream}",
    }
    prom = Prometheus(tmp_path_factory.mktemp("prometheus"), jobs).start()
    try:
        prom.wait_scraped(len(jobs))
        yield prom
    finally:
        prom.stop()


def wait_for(check: Any, limit_s: float, what: str) -> None:
    deadline = time.monotonic() + limit_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {limit_s}s")
        time.sleep(0.1)


async def call(
    session: aiohttp.ClientSession,
    url: str,
    tenant: str,
    max_tokens: int,
    output: int | None = None,
    prompt_words: int = 1,
) -> tuple[int, str]:
    """One streamed chat request read to the end: (status, x-extproc-reject-reason)."""
    body = {
        "model": MODEL,
        "max_tokens": max_tokens,
        "stream": True,
        "messages": [{"role": "user", "content": " hello" * prompt_words}],
    }
    headers = {"x-tenant-id": tenant}
    if output is not None:
        headers["x-sim-output-tokens"] = str(output)
    async with session.post(f"{url}/v1/chat/completions", json=body, headers=headers) as resp:
        await resp.read()
        return resp.status, resp.headers.get("x-extproc-reject-reason", "")


async def active_leases(session: aiohttp.ClientSession, admin_url: str) -> float:
    async with session.get(f"{admin_url}/metrics") as resp:
        text = await resp.text()
    return sum(
        float(line.split()[-1]) for line in text.splitlines() if line.startswith("extproc_active_requests ")
    )


async def one_round(
    session: aiohttp.ClientSession, url: str, admin_url: str
) -> dict[str, list[tuple[int, str]]]:
    """Hold every slot, then send what the limits refuse, what queues, and what the KV budget refuses."""
    # 4 s streams: two in the critical guarantee, two in the burstable pool (reserve 300, use 200).
    holders = [
        asyncio.create_task(call(session, url, tenant, 300, output=200))
        for tenant in ("chat", "chat", "anon", "anon")
    ]
    for _ in range(200):  # up to 10 s for all four to hold their lease
        if await active_leases(session, admin_url) >= 4:
            break
        await asyncio.sleep(0.05)
    busy = await asyncio.gather(
        *(call(session, url, "anon", 16) for _ in range(2)),  # batch does not queue: concurrency
        *(call(session, url, "chat", 16) for _ in range(3)),  # 2 wait 1 s (queue_timeout), 1 queue_full
        # A prompt larger than the whole KV budget (1,843 tokens), whatever completion is expected: kv_budget.
        call(session, url, "anon", 16, prompt_words=1900),
    )
    async with session.post(f"{url}/v1/chat/completions", data=b"{", headers={"x-tenant-id": "chat"}) as resp:
        invalid = (resp.status, "")
    return {"held": list(await asyncio.gather(*holders)), "busy": list(busy), "invalid": [invalid]}


def running(page: str) -> float:
    """The simulator's running sequences, off its metrics page."""
    for family in text_string_to_metric_families(page):
        for sample in family.samples:
            if sample.name == "vllm:num_requests_running":
                return float(sample.value)
    return 0.0


async def hold_engine_slot(session: aiohttp.ClientSession, upstream_url: str) -> None:
    """A long stream straight to the simulator, bypassing the gateway, held until cancelled."""
    body = {
        "model": MODEL,
        "max_tokens": 1000,
        "stream": True,
        "messages": [{"role": "user", "content": "x"}],
    }
    headers = {"x-sim-output-tokens": "1000"}
    async with session.post(f"{upstream_url}/v1/chat/completions", json=body, headers=headers) as resp:
        await resp.content.read(1)
        await asyncio.sleep(60)


async def engine_refusal(url: str, upstream_url: str) -> tuple[int, str]:
    """The engine's queue filled straight, then one request through the gateway: the engine refuses it
    (503, settled engine_busy), and its own counter grows in the feed."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        fillers = [asyncio.create_task(hold_engine_slot(session, upstream_url)) for _ in range(ENGINE_QUEUE)]
        try:
            for _ in range(200):  # up to 10 s for the simulator to hold them all
                async with session.get(f"{upstream_url}/metrics") as resp:
                    page = await resp.text()
                if running(page) >= ENGINE_QUEUE:
                    break
                await asyncio.sleep(0.05)
            else:
                raise AssertionError("the simulator never held the fillers")
            return await call(session, url, "anon", 16)
        finally:
            for filler in fillers:
                filler.cancel()
            await asyncio.gather(*fillers, return_exceptions=True)


async def drive(url: str, admin_url: str, rounds: int) -> list[dict[str, list[tuple[int, str]]]]:
    """Rounds a few scrapes apart: a series born with its first event shows in rate() from its second."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        outcomes = []
        for _ in range(rounds):
            outcomes.append(await one_round(session, url, admin_url))
            await asyncio.sleep(2)
        return outcomes


def has_value(series: list[dict[str, Any]]) -> bool:
    return any(not math.isnan(float(v)) for s in series for _, v in s["values"])


def test_every_dashboard_query_returns_data(stack: LocalStack, prometheus: Prometheus) -> None:
    started = time.time()
    admin = f"{stack.admin_url}/metrics"
    wait_for(lambda: metric(admin, "extproc_feed_stale", pool=MODEL) == 0, 20, "KV feed fresh")
    wait_for(lambda: metric(admin, "extproc_adaptive_scale_ratio", pool=MODEL) == 1.0, 10, "full limits")
    wait_for(lambda: metric(admin, "extproc_kv_capacity_tokens", pool=MODEL) > 0, 10, "KV capacity known")

    for outcome in asyncio.run(drive(stack.envoy_url, stack.admin_url, ROUNDS)):
        assert outcome["held"] == [(200, "")] * 4, outcome
        reasons = sorted(reason for status, reason in outcome["busy"] if status == 429)
        assert reasons == [
            "concurrency",
            "concurrency",
            "kv_budget",
            "queue_full",
            "queue_timeout",
            "queue_timeout",
        ]
        assert outcome["invalid"] == [(400, "")]

    assert asyncio.run(engine_refusal(stack.envoy_url, stack.upstream_url)) == (503, "engine_busy")
    wait_for(
        lambda: metric(admin, "extproc_feed_engine_rejections_total", pool=MODEL) == 1, 10, "fed refusal"
    )
    wait_for(lambda: metric(admin, "extproc_active_requests") == 0, 10, "every lease settled")
    time.sleep(3)  # a few scrapes after the last settlement
    end = time.time()

    empty = []
    for target in dashboard_targets():
        expr = substitute(target.expr, VARIABLES)
        if not has_value(prometheus.query_range(expr, started, end, 1.0)):
            empty.append(f"{target.panel} / {target.legend}: {expr}")
    assert not empty, "dashboard queries without data:\n" + "\n".join(empty)

    refused = prometheus.query('sum by (reason) (extproc_requests_total{decision="rejected"})')
    counted = {s["metric"]["reason"]: float(s["value"][1]) for s in refused}
    per_round = {"concurrency": 2, "queue_full": 1, "queue_timeout": 2, "kv_budget": 1, "invalid_json": 1}
    assert counted == {reason: count * ROUNDS for reason, count in per_round.items()}, counted


def test_every_alert_rule_evaluates_on_live_data(stack: LocalStack, prometheus: Prometheus) -> None:
    """No rule errors on real series (label clashes, bad matching), and a healthy stack pages no one."""
    time.sleep(2)  # at least one evaluation after the other test's traffic, or after start
    rules = [rule for group in prometheus.api("rules")["groups"] for rule in group["rules"]]
    # Every rule of the shipped PrometheusRule was loaded (a count written here went stale with a new alert).
    shipped = [rule.get("alert") or rule["record"] for group in rule_groups() for rule in group["rules"]]
    assert sorted(rule["name"] for rule in rules) == sorted(shipped)
    errors = {rule["name"]: rule.get("lastError") for rule in rules if rule["health"] != "ok"}
    assert not errors, json.dumps(errors, indent=1)
    for rule in rules:
        if rule["labels"].get("severity") == "critical":
            assert rule["state"] == "inactive", f"{rule['name']} is {rule['state']} on a healthy stack"


def test_helpers_fill_variables_like_grafana(tmp_path: Path) -> None:
    assert substitute('x{pool=~"$pool", key=~"model:($pool)"}[$__rate_interval]', VARIABLES) == (
        f'x{{pool=~"({MODEL})", key=~"model:(({MODEL}))"}}[10s]'
    )
    assert substitute("${datasource}", VARIABLES) == "prometheus"
