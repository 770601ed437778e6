"""A burst on the real engine, through the gateway as `make run UPSTREAM=` ships it, with the `openai` SDK's
default retries (issue 41): forty streamed chats of about 1,500 prompt and 300 output tokens sent at once to a
16,384-token cache that holds about eight of them, from a cold start, all answered, no preemption (the engine
alone answers every one of them; through the gateway with KV refusals at once, 7-15 of 40 were).

The config is config/local.yaml fitted to the engine (devstack/upstream.py): its default class queues
(`interactive`, 25 s), so a request the KV budget cannot take now waits for its KV as for a slot and is booked
the moment it fits (extproc/admission/capacity/booking.py `KvGate`), instead of being sent away with a
`retry-after` its SDK may spend before the KV frees. The load and the gateway are bench/protection/burst.py's
`--chats`.
"""

from __future__ import annotations

import pytest

from bench.protection import burst
from tests.support.burst import REQUESTS, SDK_DEFAULT_RETRIES
from tests.support.engine import ENGINE_TEST_TIMEOUT_S, Engine

pytestmark = [pytest.mark.engine, pytest.mark.timeout(ENGINE_TEST_TIMEOUT_S)]


def test_a_burst_the_engine_serves_is_served_through_the_shipped_config(engine: Engine) -> None:
    burst.wait_engine_idle(engine)
    outcome = burst.chats_through_shipped(engine, SDK_DEFAULT_RETRIES, 7_000)
    assert outcome.answered == REQUESTS, outcome
    assert outcome.preemptions == 0, outcome
