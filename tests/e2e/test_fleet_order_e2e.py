"""Two gateways with the shipped class queue in front of one engine: the clients of both are answered alike
(`FleetOrder`, extproc/core/kv/order.py).

Divided between the replicas, not their clients, the free room served one gateway's clients far more often
than the other's: at 90/10 on the bench the small gateway's three, 14.7-17.7 answers each against 5.6-5.9;
here, with three of twelve clients on one gateway, the busy one's nine, 1.7 and 2.6 times as often in two
runs. With one order across the fleet for the requests that wait for KV, each client is answered about as
often whichever gateway holds it (1.14-1.24 here in three runs), the engine never preempts, and it never runs
more than the fleet holds admitted.
"""

from __future__ import annotations

import statistics
from typing import Any

import pytest
import yaml

from extproc.envoyconf.profiles import REPO
from tests.support.fleet import MODEL, Fleet, Load, Sampler, drive, running_over_admitted, split
from tests.support.stack import fixed_step_sim

pytestmark = pytest.mark.e2e

CLIENTS = 12
SHARES = (75, 25)
CACHE_TOKENS = 8_192
STEP_MS = 10
"""A fixed decode step whatever the batch: a 300-token answer streams for 3 s."""
SECONDS = 24.0
FAIR_RATIO = 1.6
"""The most one gateway's clients may be answered, each, over the other's (module docstring)."""


def shipped_config() -> dict[str, Any]:
    """k8s/gateway/config.yaml, its slot and TPM limits raised so the KV budget binds, its store's Redis
    calls given a second (as tests/e2e/test_fleet_e2e.py: on a loaded host the shipped 50 ms sends
    admissions to the local fallback)."""
    config: dict[str, Any] = yaml.safe_load((REPO / "k8s" / "gateway" / "config.yaml").read_text())
    config["limits"]["global"] = {**config["limits"].get("global", {}), "max_concurrency": 512}
    config["limits"]["models"][MODEL] = {"max_concurrency": 512, "tokens_per_minute": 10**9}
    config["limits"]["tenant_default"] = {"tokens_per_minute": 10**9}
    config["kv_budget"]["capacity_share"] = 1.0
    config["store"]["redis"]["timeout_ms"] = 1000
    config["log_level"] = "warning"
    return config


def test_each_client_is_answered_alike_whichever_gateway_holds_it() -> None:
    sim_args = fixed_step_sim(MODEL, STEP_MS, "--num-gpu-blocks", str(CACHE_TOKENS // 16))[2:]
    load = Load(gateway_of=split(CLIENTS, SHARES), seconds=SECONDS)
    with Fleet(shipped_config(), gateways=2, sim_args=sim_args) as fleet:
        fleet.wait_fed(60)
        assert fleet.redis is not None
        with Sampler(fleet.sim_url, fleet.redis.url) as sampler:
            tally = drive(fleet.urls, load)
    clients = [load.gateway_of.count(i) for i in range(2)]
    each = [answered / n for answered, n in zip(tally.answered, clients, strict=True)]
    samples = sampler.samples
    print(f"answered {tally.answered} by {clients} clients, {each}; refused {tally.refused}")
    assert sum(tally.errors) == 0 and sum(tally.refused) == 0, tally
    assert min(each) >= 2, each  # the load reached both gateways' queues
    assert max(each) <= FAIR_RATIO * min(each), each
    assert samples and samples[-1].preemptions - samples[0].preemptions == 0
    assert running_over_admitted(samples) <= 0
    assert statistics.fmean(s.kv for s in samples) > 0.3  # the KV budget, not the clients, was the bound
