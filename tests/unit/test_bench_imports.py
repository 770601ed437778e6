"""Every benchmark module imports: a benchmark is run by hand, so a moved or renamed name it imports would
otherwise break only when someone next runs it (bench.protection.engine once asked tests/engine's conftest
for constants that had moved to tests/support/engine.py)."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

import bench

MODULES = sorted(info.name for info in pkgutil.walk_packages(bench.__path__, "bench."))


def test_the_benchmarks_are_found() -> None:
    assert "bench.protection.engine" in MODULES and "bench.overhead.profiles" in MODULES


@pytest.mark.parametrize("module", MODULES)
def test_module_imports(module: str) -> None:
    importlib.import_module(module)
