"""A burst on the real engine, through the gateway as shipped, with the `openai` SDK's default retries: forty
requests of about 1,400 prompt and 500 output tokens sent at once to a 16,384-token cache that holds about
eight of them, all answered, no preemption (issue 41: the engine alone answers every one of them; through
the gateway with KV refusals at once, 7-15 of 40 were).

The shipped config's default class queues (config/local.yaml, `interactive`: 25 s), so a request the KV budget
cannot take now waits for its KV as for a slot and is booked the moment it fits
(extproc/admission/capacity/booking.py `KvGate`), instead of being sent away with a `retry-after` its SDK may
spend before the KV frees. The load and the gateway are bench/protection/burst.py's.
"""

from __future__ import annotations

import pytest
import yaml

from bench.protection import burst
from devstack.stack import LOCAL_CONFIG
from tests.support.engine import ENGINE_TEST_TIMEOUT_S, Engine

pytestmark = [pytest.mark.engine, pytest.mark.timeout(ENGINE_TEST_TIMEOUT_S)]


def shipped_queue_s() -> float:
    """How long the shipped config's default class queues a request."""
    config = yaml.safe_load(LOCAL_CONFIG.read_text())
    default = config["default_class"]
    return float(next(c for c in config["classes"] if c["name"] == default)["queue"]["max_wait_seconds"])


def test_a_burst_the_engine_serves_is_served_through_the_shipped_queue(engine: Engine) -> None:
    outcome = burst.through_gateway(engine, "lean", 7_000, queue_s=shipped_queue_s())
    assert outcome.failed == 0, outcome
    assert outcome.answered == burst.REQUESTS, outcome
    assert outcome.preemptions == 0, outcome
