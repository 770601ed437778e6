"""The real-engine tier (tests/engine/conftest.py)."""

import pytest

pytest.register_assert_rewrite("tests.engine.stacks")
