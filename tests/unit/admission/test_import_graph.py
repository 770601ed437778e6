"""No import cycle inside extproc/admission: the API specs depend on the shared types, the registry on the
specs, and the admission functions on the registry, never the other way round.

The graph is read from the source (no import runs), with every import a module makes, inside functions
too: a deferred import is how a cycle hides, and it still makes the modules depend on each other. Imports
under `if TYPE_CHECKING:` are left out (they never run). A package's `__init__` importing its own
submodules is not a cycle: a submodule never imports its package's names.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
PACKAGE = "extproc.admission"


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _runtime_nodes(tree: ast.AST) -> Iterator[ast.AST]:
    """Every node that runs, leaving out the bodies of `if TYPE_CHECKING:`."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                stack.extend(child.orelse)
                continue
            stack.append(child)


def imports_of(tree: ast.AST, modules: set[str]) -> set[str]:
    """The modules of `modules` that this source imports (`from pkg import sub` names the submodule)."""
    found: set[str] = set()
    for node in _runtime_nodes(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in modules)
        elif isinstance(node, ast.ImportFrom) and node.module is not None and node.level == 0:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                if sub in modules:
                    found.add(sub)
                elif node.module in modules:
                    found.add(node.module)
    return found


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """Module -> the package's modules it imports, for every module under `package` in `root`."""
    folder = root.joinpath(*package.split("."))
    paths = sorted(folder.rglob("*.py"))
    names = {module_name(path, root): path for path in paths}
    modules = set(names)
    return {
        name: imports_of(ast.parse(path.read_text(encoding="utf-8")), modules) - {name}
        for name, path in names.items()
    }


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (its modules in order, the first repeated last), or None."""
    done: set[str] = set()
    path: list[str] = []
    on_path: set[str] = set()

    def visit(node: str) -> list[str] | None:
        path.append(node)
        on_path.add(node)
        for target in sorted(graph.get(node, ())):
            if target in on_path:
                return [*path[path.index(target) :], target]
            if target not in done:
                cycle = visit(target)
                if cycle is not None:
                    return cycle
        path.pop()
        on_path.discard(node)
        done.add(node)
        return None

    for start in sorted(graph):
        if start not in done:
            cycle = visit(start)
            if cycle is not None:
                return cycle
    return None


def test_the_admission_package_has_no_import_cycle() -> None:
    graph = import_graph(ROOT, PACKAGE)
    assert f"{PACKAGE}.apis" in graph and f"{PACKAGE}.request" in graph  # the walk found the package
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])


def test_the_api_modules_never_import_the_admission_functions_or_the_registry() -> None:
    """The layering the cycle test keeps: an API's module sees the shared types, never what uses it."""
    graph = import_graph(ROOT, PACKAGE)
    above = {f"{PACKAGE}.{name}" for name in ("request", "reading", "paths", "exchange", "service", "apis")}
    for module, targets in graph.items():
        if module.startswith(f"{PACKAGE}.apis."):
            assert not targets & above, f"{module} imports {sorted(targets & above)}"


def test_the_cycle_finder_finds_a_deferred_import_cycle() -> None:
    """A function-level import counts: it is how the registry and the request functions once met."""
    modules = {"p.a", "p.b"}
    deferred = ast.parse("def f():\n    from p.b import thing\n")
    direct = ast.parse("from p import a\n")
    graph = {"p.a": imports_of(deferred, modules), "p.b": imports_of(direct, modules)}
    assert find_cycle(graph) == ["p.a", "p.b", "p.a"]
    guarded = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from p.b import thing\n")
    assert imports_of(guarded, modules) == set()
