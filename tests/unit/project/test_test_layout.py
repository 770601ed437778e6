"""The tests tree's own rule: a test module imports only support modules (tests/support/, a directory's
helper modules), never another test module nor a conftest, and support modules and conftests do not either.
Importing a test module runs its module-level fixtures and constants in a second place and ties one suite's
layout to another's; a helper two suites need belongs in a support module."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[2]


def package_of(path: Path) -> str:
    """The dotted package a file sits in (`tests/unit/kvfeed/x.py` is in `tests.unit.kvfeed`)."""
    return ".".join(path.relative_to(TESTS.parent).parent.parts)


def absolute(node: ast.ImportFrom, package: str) -> str:
    """The module a `from ... import` names, with a relative one (`from .x`, `from ..`) resolved against the
    importing file's package, as Python resolves it."""
    if node.level == 0:
        return node.module or ""
    parts = package.split(".")
    base = ".".join(parts[: len(parts) - (node.level - 1)])
    return f"{base}.{node.module}" if node.module else base


def called_name(call: ast.Call) -> str:
    """The name a call spells: `f` for `f(...)` and for `m.f(...)`."""
    func = call.func
    if isinstance(func, ast.Name):
        return func.id
    return func.attr if isinstance(func, ast.Attribute) else ""


def imported_modules(tree: ast.Module, package: str = "tests") -> list[str]:
    """Every module a file imports, at any depth (a function-level import counts too), relative imports
    resolved against `package`; for `from m import n` both `m` and `m.n` (n may be a submodule); a module
    named by a literal to `importlib.import_module` or `__import__` too."""
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and called_name(node) in ("import_module", "__import__"):
            first = node.args[0] if node.args else None
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                names.append(first.value)
        elif isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            module = absolute(node, package)
            names.append(module)
            names.extend(f"{module}.{alias.name}" for alias in node.names)
    return names


TEST_MODULE_NAMES = {path.stem for path in TESTS.rglob("test_*.py")}


def forbidden(module: str) -> bool:
    """A test module or a conftest, by any spelling: dotted under `tests`, or the bare top-level name pytest's
    rootdir path insertion would make importable (`conftest`, `test_engine_fixtures`)."""
    parts = module.split(".")
    leaf = parts[-1]
    if parts[0] == "tests":
        return leaf.startswith("test_") or leaf == "conftest"
    return len(parts) == 1 and (leaf == "conftest" or leaf in TEST_MODULE_NAMES)


def violations() -> list[str]:
    found: list[str] = []
    for path in sorted(TESTS.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for module in sorted(set(imported_modules(tree, package_of(path)))):
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


def test_the_rule_resolves_relative_imports_and_bare_names() -> None:
    source = (
        "from .test_engine_fixtures import page\n"
        "from .conftest import chat_body\n"
        "from . import conftest\n"
        "from ..support import stack\n"
        "from .helpers import poll\n"
        "import conftest\n"
        "from test_engine_fixtures import page\n"
        "importlib.import_module('tests.e2e.test_usage_e2e')\n"
        "__import__('tests.unit.kvfeed.conftest')\n"
    )
    caught = [m for m in imported_modules(ast.parse(source), "tests.unit.kvfeed") if forbidden(m)]
    assert caught == [
        "tests.unit.kvfeed.test_engine_fixtures",
        "tests.unit.kvfeed.conftest",
        "tests.unit.kvfeed.conftest",
        "conftest",
        "test_engine_fixtures",
        "tests.e2e.test_usage_e2e",
        "tests.unit.kvfeed.conftest",
    ]


def constructs_local_stack(tree: ast.Module) -> bool:
    """Whether a file calls `LocalStack(...)` (by its name or as `stack.LocalStack(...)`)."""
    return any(isinstance(node, ast.Call) and called_name(node) == "LocalStack" for node in ast.walk(tree))


def test_stacks_are_built_one_way() -> None:
    """Every test's local stack comes from tests/support/stack.py's `build_stack` / `start_stack`, so the
    tenant-header trust, the free ports and the options a stack takes are decided in one place."""
    support = TESTS / "support"
    direct = [
        str(path.relative_to(TESTS.parent))
        for path in sorted(TESTS.rglob("*.py"))
        if support not in path.parents and constructs_local_stack(ast.parse(path.read_text()))
    ]
    assert direct == []


def test_the_stack_rule_sees_both_call_forms() -> None:
    assert constructs_local_stack(ast.parse("s = LocalStack(ports=p)\n"))
    assert constructs_local_stack(ast.parse("import devstack.stack as d\ns = d.LocalStack()\n"))
    assert not constructs_local_stack(ast.parse("def f(s: LocalStack) -> None: ...\n"))


def defined_tests(folder: Path) -> set[str]:
    """The test functions defined in a folder's test modules."""
    return {
        node.name
        for path in folder.glob("test_*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name.startswith("test_")
    }


def test_the_store_suites_keep_no_copies_of_the_limiter_unit_cases() -> None:
    """A limiter case the stores must agree on is written once (tests/support/limiter_cases.py) and run on
    each store by parametrization; a test of the same name in both places is a copy that drifts."""
    assert defined_tests(TESTS / "component" / "store") & defined_tests(TESTS / "unit" / "core") == set()
