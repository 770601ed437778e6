"""No import cycle inside extproc/admission: the API specs depend on the shared types, the registry on the
specs, and the admission functions on the registry, never the other way round. The graph is read from the
source, deferred imports included (tests/support/imports.py says how)."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.support.imports import find_cycle, import_graph, imports_of

ROOT = Path(__file__).resolve().parents[3]
PACKAGE = "extproc.admission"


def test_the_admission_package_has_no_import_cycle() -> None:
    graph = import_graph(ROOT, PACKAGE)
    assert f"{PACKAGE}.apis" in graph and f"{PACKAGE}.intake.request" in graph  # the walk found the package
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])


def test_the_api_modules_never_import_the_admission_functions_or_the_registry() -> None:
    """The layering the cycle test keeps: an API's module sees the shared types, never what uses it."""
    graph = import_graph(ROOT, PACKAGE)
    names = (
        "intake.request",
        "intake.reservation",
        "tracking.reading",
        "intake.paths",
        "exchange",
        "service",
        "apis",
    )
    above = {f"{PACKAGE}.{name}" for name in names}
    assert above <= set(graph)  # each named module exists: the check cannot pass for want of them
    for module, targets in graph.items():
        if module.startswith(f"{PACKAGE}.apis."):
            assert not targets & above, f"{module} imports {sorted(targets & above)}"


def test_the_cycle_finder_finds_a_deferred_import_cycle() -> None:
    """A function-level import counts: it is how the registry and the request functions once met. A type-only
    one counts too: it is how the in-flight request and the service once met."""
    modules = {"p.a", "p.b"}
    deferred = ast.parse("def f():\n    from p.b import thing\n")
    direct = ast.parse("from p import a\n")
    graph = {"p.a": imports_of(deferred, modules), "p.b": imports_of(direct, modules)}
    assert find_cycle(graph) == ["p.a", "p.b", "p.a"]
    guarded = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from p.b import thing\n")
    assert imports_of(guarded, modules) == {"p.b"}
