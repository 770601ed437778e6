"""Two gateways in front of the real engine, sharing one store (issue 39): the protection overload of
tests/engine/test_protection_engine.py sent through both at once, half through each.

Each gateway (Envoy + sidecar + its own exporter scraping vLLM) books the pool's KV budget through the shared
Redis, so together they admit what the one cache holds, not twice it; the engine-done inference reads the
pool's running count against every replica's leases, so no gateway gives back the slot of a request the
engine still runs. Asserted from the engine's own counters: every request served, no preemption, and at
every sample the engine running no more requests than the fleet holds slots for (sampled between two reads
of the leases in Redis, tests/support/fleet.py `Sample`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from tests.engine.overload import REQUESTS, overload, preemptions, protected_config
from tests.engine.stacks import engine_host_envoy
from tests.support.engine import CACHE_TOKENS, ENGINE_TEST_TIMEOUT_S, MODEL, Engine
from tests.support.fleet import Fleet, Sampler, running_over_held
from tests.support.stack import http, metric

pytestmark = [pytest.mark.engine, pytest.mark.timeout(ENGINE_TEST_TIMEOUT_S)]

SAMPLE_INTERVAL_S = 0.2
"""vLLM's metrics page costs the two-core host more than the simulator's: five reads a second, not twenty."""


@pytest.fixture(scope="module")
def fleet(engine: Engine) -> Iterator[Fleet]:
    started = Fleet(
        protected_config(),
        gateways=2,
        profile="lean",
        engine_port=engine.port,
        exporter_args=("--interval", "2", "--timeout", "15"),
        envoy_patch=engine_host_envoy,
    )
    with started:
        yield started


def warm(fleet: Fleet) -> None:
    """Until both sidecars know the cache and each other, then one short stream through each: a pool in
    service has a decode pace learned from finished streams (the KV refusals' retry-after uses it)."""
    fleet.wait_fed(limit_s=120)
    for index, url in enumerate(fleet.urls):
        assert fleet.sidecar(index, "extproc_kv_capacity_tokens") == CACHE_TOKENS
        warm_body = {"model": MODEL, "prompt": "warm up", "max_tokens": 32, "stream": True}
        assert http("POST", f"{url}/v1/completions", warm_body).status == 200
    wait_fleet_idle(fleet)


def wait_fleet_idle(fleet: Fleet, limit_s: float = 60.0) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        held = sum(metric(f"{url}/metrics", "extproc_active_requests") for url in fleet.admin_urls)
        if held == 0:
            return
        time.sleep(0.1)
    raise AssertionError(f"the fleet still holds requests after {limit_s}s")


def test_two_gateways_serve_the_overload_and_preempt_nothing(engine: Engine, fleet: Fleet) -> None:
    warm(fleet)
    assert fleet.redis is not None
    before = preemptions(engine)
    with Sampler(engine.url, fleet.redis.url, interval_s=SAMPLE_INTERVAL_S) as sampler:
        results = overload(fleet.urls, 3000)
    samples = sampler.samples
    print(
        f"fleet of two: KV peak {max((s.kv for s in samples), default=0):.2f}, "
        f"running at most {max((s.running for s in samples), default=0):.0f}, "
        f"{sum(len(given) for _, given in results)} refusals, {len(samples)} samples"
    )
    assert [status for status, _ in results] == [200] * REQUESTS
    assert any(given for _, given in results), "the overload never reached the KV budget"
    assert preemptions(engine) - before == 0
    assert len(samples) >= 20, (len(samples), sampler.failed)
    assert max(s.running for s in samples) > 0, "the sampler never saw the engine run"
    # No slot given back while the engine runs its request: the engine never ran more than the fleet held.
    assert running_over_held(samples) <= 0, [(s.running, s.held) for s in samples if s.running > s.held]
    wait_fleet_idle(fleet)
