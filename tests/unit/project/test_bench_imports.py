"""Every benchmark module and recording script imports: they are run by hand, so a moved or renamed name
they import would otherwise break only when someone next runs them (bench.protection.engine once asked
tests/engine's conftest for constants that had moved to tests/support/engine.py; scripts/
record_dashboard_run.py kept importing TRACE_START_S from bench.protection.main after it moved)."""

from __future__ import annotations

import importlib
import importlib.util
import pkgutil
import sys
from pathlib import Path

import pytest

import bench

MODULES = sorted(info.name for info in pkgutil.walk_packages(bench.__path__, "bench."))
SCRIPTS = sorted((Path(__file__).resolve().parents[3] / "scripts").glob("*.py"))


def test_the_benchmarks_are_found() -> None:
    assert "bench.protection.engine" in MODULES and "bench.overhead.profiles" in MODULES


@pytest.mark.parametrize("module", MODULES)
def test_module_imports(module: str) -> None:
    importlib.import_module(module)


def test_the_scripts_are_found() -> None:
    assert "record_dashboard_run.py" in {script.name for script in SCRIPTS}


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda script: script.name)
def test_script_imports(script: Path) -> None:
    """Loaded as a module, not run: each script runs its work only under `__main__`."""
    name = f"scripts_{script.stem}"
    spec = importlib.util.spec_from_file_location(name, script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # as an import registers it: a dataclass looks its module up there
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[name]
