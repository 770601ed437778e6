"""The tests tree's own rule: a test module imports only support modules (tests/support/, a directory's
helper modules), never another test module nor a conftest, and support modules and conftests do not either.
Importing a test module runs its module-level fixtures and constants in a second place and ties one suite's
layout to another's; a helper two suites need belongs in a support module."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def imported_modules(tree: ast.Module) -> list[str]:
    """Every absolute module a file imports, at any depth (a function-level import counts too)."""
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module is not None and node.level == 0:
            names.append(node.module)
            names.extend(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def forbidden(module: str) -> bool:
    """A module of the tests tree that is a test module or a conftest."""
    parts = module.split(".")
    leaf = parts[-1]
    return parts[0] == "tests" and (leaf.startswith("test_") or leaf == "conftest")


def violations() -> list[str]:
    found: list[str] = []
    for path in sorted(TESTS.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for module in sorted(set(imported_modules(tree))):
            if forbidden(module):
                found.append(f"{path.relative_to(TESTS.parent)} imports {module}")
    return found


def test_no_module_of_the_tests_tree_imports_a_test_module_or_a_conftest() -> None:
    assert violations() == []


def test_the_rule_sees_each_import_form() -> None:
    source = (
        "import tests.e2e.test_usage_e2e\n"
        "from tests.component.test_server import chat\n"
        "from tests.e2e import conftest\n"
        "from tests.support.servicer import chat as c\n"
        "def f():\n    from tests.component.store.test_cluster import until\n"
    )
    caught = [m for m in imported_modules(ast.parse(source)) if forbidden(m)]
    assert caught == [
        "tests.e2e.test_usage_e2e",
        "tests.component.test_server",
        "tests.e2e.conftest",
        "tests.component.store.test_cluster",
    ]
