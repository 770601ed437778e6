"""One lean request body, followed from `LeanTranslator._on_body` through its calls (tests/support/walk.py),
enters the decision no more often than docs/architecture.md says: a change that sends the decision back and
forth between more modules shows here as a higher count."""

from __future__ import annotations

from tests.support.servicer import BASE_CONFIG, chat
from tests.support.walk import COUNTED_FIRST, walk

DECISION = "deciding/decision.py"


async def test_a_body_admitted_on_its_bound_enters_the_decision_at_most_13_times() -> None:
    entries = await walk(chat(), BASE_CONFIG)
    # The exchange's one call; every other entry is the decision's own step called after a call elsewhere.
    assert entries.calls[DECISION] == 1
    assert 0 < entries.entries[DECISION] <= 13


async def test_a_body_counted_first_enters_the_decision_at_most_15_times() -> None:
    entries = await walk(chat(), COUNTED_FIRST)
    assert entries.calls[DECISION] == 1
    assert 0 < entries.entries[DECISION] <= 15
