"""A burst on the real engine, through the gateway, with the `openai` SDK's default retries: forty requests of
about 1,400 prompt and 500 output tokens sent at once to a 16,384-token cache that holds about eight of them
(issue 28's target: at least 36 answered, no preemption).

The class queues for 90 s, so a request the KV budget cannot take now waits for its KV as for a slot and is
booked the moment it fits (extproc/admission/capacity/booking.py `KvGate`), instead of being sent away with a
`retry-after` its SDK may spend before the KV frees (bench/RESULTS.md section 9: 15 of 40 answered without the
queue, the SDK's three attempts spanning under a minute while the burst takes two and a half). The load and
the gateway are bench/protection/burst.py's.
"""

from __future__ import annotations

import pytest

from bench.protection import burst
from tests.support.engine import ENGINE_TEST_TIMEOUT_S, Engine

pytestmark = [pytest.mark.engine, pytest.mark.timeout(ENGINE_TEST_TIMEOUT_S)]


def test_a_burst_that_queues_for_its_kv_is_answered_without_a_preemption(engine: Engine) -> None:
    outcome = burst.through_gateway(engine, "lean", 7_000, queue_s=90.0)
    assert outcome.failed == 0, outcome
    assert outcome.answered >= 36, outcome
    assert outcome.preemptions == 0, outcome
