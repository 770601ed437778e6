"""One lean request body, followed from `LeanTranslator._on_body` through its calls (tests/support/walk.py),
enters no admission module more often than docs/architecture.md says: a change that sends the walk back
and forth between modules more often shows here as a higher count."""

from __future__ import annotations

from typing import Any

import pytest

from tests.support.servicer import BASE_CONFIG, chat
from tests.support.walk import COUNTED_FIRST, walk

DECISION = "deciding/decision.py"

MOST_ENTRIES = 6
"""The most entries into any one admission module, in either walk."""


@pytest.mark.parametrize(
    "config", [BASE_CONFIG, COUNTED_FIRST], ids=["admitted on its bound", "counted first"]
)
async def test_a_body_enters_no_admission_module_more_than_6_times(config: dict[str, Any]) -> None:
    entries = await walk(chat(), config)
    # The exchange's one call; the decision's other entries are its resumptions around the lease's await.
    assert entries.calls[DECISION] == 1
    assert 0 < entries.entries[DECISION] <= 4
    module, most = entries.entries.most_common(1)[0]
    assert most <= MOST_ENTRIES, f"{module} entered {most} times"
