"""No class of extproc/ over `MAX_CLASS_LINES` lines and no function over `MAX_FUNCTION_LINES` (docstrings not
counted), but those docs/architecture.md's `## Sizes` table names with why: declarative tables (metric
definitions, argument parsers) and what is still to be split. A definition named there that is within the
bounds again, or that does not exist, fails too, so the table never hides a new one."""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
DOC = ROOT / "docs" / "architecture.md"
MAX_CLASS_LINES = 300
MAX_FUNCTION_LINES = 60
ROW = re.compile(r"^\| `(extproc/[^`]+\.py)` `([\w.]+)` \| (.+) \|$")


def lines_of(node: ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """The definition's lines, its docstring left out."""
    assert node.end_lineno is not None
    count = node.end_lineno - node.lineno + 1
    first = node.body[0] if node.body else None
    if (
        isinstance(first, ast.Expr)
        and isinstance(first.value, ast.Constant)
        and isinstance(first.value.value, str)
    ):
        assert first.end_lineno is not None
        count -= first.end_lineno - first.lineno + 1
    return count


def definitions(
    tree: ast.AST, prefix: str = ""
) -> list[tuple[str, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef]]:
    """Every class and function by its qualified name (`Class.method`), nested ones included."""
    found: list[tuple[str, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef]] = []
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            name = prefix + node.name
            found.append((name, node))
            found.extend(definitions(node, name + "."))
        else:
            found.extend(definitions(node, prefix))
    return found


def oversized(source: str) -> dict[str, int]:
    """The definitions of a module over their bound, by qualified name, with their lines."""
    over: dict[str, int] = {}
    for name, node in definitions(ast.parse(source)):
        bound = MAX_CLASS_LINES if isinstance(node, ast.ClassDef) else MAX_FUNCTION_LINES
        if (count := lines_of(node)) > bound:
            over[name] = count
    return over


@functools.cache
def exempt() -> dict[tuple[str, str], str]:
    """The `## Sizes` table: (path, qualified name) -> why."""
    section = DOC.read_text(encoding="utf-8").split("\n## Sizes\n", 1)[1].split("\n## ", 1)[0]
    rows = {(m.group(1), m.group(2)): m.group(3) for line in section.splitlines() if (m := ROW.match(line))}
    assert rows, "docs/architecture.md has a `## Sizes` table"
    return rows


@functools.cache
def found_over() -> dict[tuple[str, str], int]:
    over: dict[tuple[str, str], int] = {}
    for path in sorted((ROOT / "extproc").rglob("*.py")):
        if path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
            continue  # protoc's output
        relative = path.relative_to(ROOT).as_posix()
        for name, count in oversized(path.read_text(encoding="utf-8")).items():
            over[(relative, name)] = count
    return over


def test_no_definition_is_over_its_bound_unless_the_doc_says_why() -> None:
    unexplained = {
        f"{path} {name}": count
        for (path, name), count in found_over().items()
        if (path, name) not in exempt()
    }
    assert unexplained == {}, "over the bounds: shorten them, or name them in docs/architecture.md's ## Sizes"


def test_every_definition_the_doc_names_is_still_over_its_bound() -> None:
    stale = sorted(f"{path} {name}" for path, name in exempt() if (path, name) not in found_over())
    assert stale == [], "within the bounds (or gone): remove their rows from docs/architecture.md's ## Sizes"


def test_the_count_leaves_out_the_docstring_and_names_nested_definitions() -> None:
    body = "\n".join(f"        x = {i}" for i in range(MAX_FUNCTION_LINES - 1))
    source = f'class A:\n    def f(self):\n        """Why.\n\n        More."""\n{body}\n'
    assert oversized(source) == {}  # 60 lines with the signature, the 3-line docstring not counted
    assert oversized(source + "        x = 0\n") == {"A.f": MAX_FUNCTION_LINES + 1}
