"""Marks every test under tests/e2e as `e2e`, so `pytest -m "not e2e"` runs without starting processes, and
has pytest rewrite the asserts of the support modules that hold shared test cases."""

from __future__ import annotations

from pathlib import Path

import pytest

# The limiter's behaviour cases assert in a support module: rewritten like a test module's, a failing case
# shows its values.
pytest.register_assert_rewrite("tests.support.limiter_cases", "tests.support.store_harness")

E2E_DIR = Path(__file__).parent / "e2e"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if E2E_DIR in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.e2e)
