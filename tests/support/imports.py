"""The import graph of a package read from its source (no import runs), for the tests that keep the layers
and the absence of cycles true.

Every import a module makes counts, inside functions and under `if TYPE_CHECKING:` too: a deferred import is
how a cycle hides, and a type-only one still makes the modules depend on each other's names (the circle is in
the design, whether or not it runs). A package's `__init__` importing its own submodules is not a cycle: a
submodule never imports its package's names.
"""

from __future__ import annotations

import ast
from pathlib import Path


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(tree: ast.AST, modules: set[str]) -> set[str]:
    """The modules of `modules` that this source imports (`from pkg import sub` names the submodule)."""
    found: set[str] = set()
    for node in ast.walk(tree):
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


def external_imports(tree: ast.AST) -> set[str]:
    """Every absolute module name this source imports, whatever package it belongs to."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module is not None and node.level == 0:
            found.add(node.module)
    return found
