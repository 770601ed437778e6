"""The Redis store package keeps to its layering: it uses only the core's public shared state, and its
modules import each other without cycles (each part can be read, and changed, on its own)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
PACKAGE = ROOT / "extproc" / "store" / "redis"
MAX_LINES = 350
"""The store was one 1,000-line class; no part of it may grow back to that (scripts.py is Lua text)."""


def imports(path: Path) -> list[ast.ImportFrom]:
    tree = ast.parse(path.read_text(), filename=str(path))
    return [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module]


def test_the_package_uses_no_private_name_of_the_core() -> None:
    private = [
        f"{path.name}: {node.module}.{alias.name}"
        for path in PACKAGE.glob("*.py")
        for node in imports(path)
        if node.module and node.module.startswith("extproc.core")
        for alias in node.names
        if alias.name.startswith("_")
    ]
    assert private == []


def test_modules_import_each_other_without_cycles() -> None:
    prefix = "extproc.store.redis."
    graph = {
        path.stem: {
            n.module.removeprefix(prefix) for n in imports(path) if n.module and n.module.startswith(prefix)
        }
        for path in PACKAGE.glob("*.py")
        if path.stem != "__init__"
    }
    assert len(graph) >= 10 and "store" in graph and "leases" in graph["store"]  # the walk sees real edges
    done: set[str] = set()

    def visit(module: str, path: tuple[str, ...]) -> None:
        assert module not in path, f"import cycle: {' -> '.join((*path, module))}"
        if module in done:
            return
        for other in graph.get(module, ()):
            visit(other, (*path, module))
        done.add(module)

    for module in graph:
        visit(module, ())


def test_every_part_is_short() -> None:
    long = {
        p.name: n
        for p in PACKAGE.glob("*.py")
        if p.name != "scripts.py" and (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}
