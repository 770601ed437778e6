"""The layer table of docs/architecture.md holds in the code: it names every module of extproc/ and nothing
that does not exist, every import follows its "may import" column, every module does only the I/O its row
names, and neither extproc/ nor bench/ has an import cycle between modules. Every import counts, a deferred
one and a type-only one (under `if TYPE_CHECKING:`) alike (tests/support/imports.py).

The rules are read from the doc's table, so the doc is the one place they are written: a row added, a module
moved or a rule changed there is what this test checks the code against. Each row's first cell names the
files or folders it covers (a file's own row holds over its folder's); its "holds" cell, with the docstring
of a folder's `__init__.py` (a package lists its modules there, beside them), names each module by its path
from the row's folder (`redis/` followed by a parenthesis names the modules inside it from `redis/`); its
"may import" cell lists rows by their path, or single modules of a row. Dependencies point
inward: the core imports nothing of the project, the admission core and the stores only the core, the
protocol layers the admission core, and the composition (app, cli) everything. The local stack (devstack/),
the benchmarks and the tests sit outside the product: they import extproc, never the reverse. Where code
breaks a rule the import is listed in `KNOWN_EXCEPTIONS` with why; any other import across a rule fails.
"""

from __future__ import annotations

import ast
import functools
import re
from dataclasses import dataclass
from pathlib import Path

from tests.support.imports import external_imports, find_cycle, import_graph, module_name

ROOT = Path(__file__).resolve().parents[3]
DOC = ROOT / "docs" / "architecture.md"
NOTHING = ("none", "\u2013")  # "none" and an en dash both say a cell lists nothing
EVERYWHERE = re.compile(r"Every row may also import ((?:`[^`]+`(?:, | and )?)+)\.")
"""The sentence of the doc naming what every row may import besides its own column (JSON logging)."""


@dataclass(frozen=True)
class Layer:
    """One row of the doc's table: its first cell (verbatim, its name here), the files or folders it
    covers, its "holds" cell, its I/O words and the paths it may import."""

    row: str
    paths: tuple[str, ...]
    holds: str
    io: frozenset[str]
    may_import: tuple[str, ...]


def _words(cell: str) -> frozenset[str]:
    return frozenset(word.strip() for word in cell.split(",")) - set(NOTHING)


def package_docstring(path: str) -> str:
    """The docstring of a folder's `__init__.py` ("" for a file or a package without one): a package's own
    list of its modules lives there, beside the code, and counts as its row's "holds" text."""
    init = ROOT / path / "__init__.py"
    if not path.endswith("/") or not init.is_file():
        return ""
    return ast.get_docstring(ast.parse(init.read_text(encoding="utf-8"))) or ""


def doc_layers(text: str) -> dict[str, Layer]:
    """The rows of the table under `## Layers`, by their first cell."""
    section = text.split("\n## Layers\n", 1)[1].split("\n## ", 1)[0]
    layers: dict[str, Layer] = {}
    for line in section.splitlines():
        if not line.startswith("|"):
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        assert len(cells) == 4, f"a layer row has 4 cells (no `|` inside one): {line[:80]}"
        if cells[0] in ("package", "---"):
            continue
        paths = tuple(re.findall(r"`(extproc/[^`]*)`", cells[0]))
        layers[cells[0]] = Layer(
            row=cells[0],
            paths=paths,
            holds=" ".join([cells[1], *(package_docstring(path) for path in paths)]),
            io=_words(cells[2]),
            may_import=tuple(re.findall(r"`([^`]+)`", cells[3])),
        )
    return layers


def doc_everywhere(text: str) -> tuple[str, ...]:
    found = EVERYWHERE.search(" ".join(text.split()))
    assert found is not None, "docs/architecture.md says what every row may import"
    return tuple(re.findall(r"`([^`]+)`", found.group(1)))


@functools.cache
def layers() -> dict[str, Layer]:
    return doc_layers(DOC.read_text(encoding="utf-8"))


@functools.cache
def everywhere() -> tuple[str, ...]:
    return doc_everywhere(DOC.read_text(encoding="utf-8"))


# Imports that break a rule, each (importing module, imported module) with why. The test fails on any other;
# remove an entry when the import goes. None is left: add one only with its reason.
KNOWN_EXCEPTIONS: dict[tuple[str, str], str] = {}

# Import cycles allowed, each as its set of modules with why. None is left: add one only with its reason.
CYCLE_EXCEPTIONS: dict[frozenset[str], str] = {}

# I/O libraries by the doc's word for them. Files are not told apart by imports (pathlib is everywhere), so a
# row's `files` is not checked.
IO_LIBRARIES: dict[str, tuple[str, ...]] = {
    "gRPC": ("grpc", "grpc_health"),
    "HTTP": ("aiohttp", "http.client", "http.server", "urllib.request"),
    "Redis": ("redis",),
    "processes": ("subprocess",),
}
IO_WORDS = {*IO_LIBRARIES, "files"}
# Envoy's protocol messages: a layer whose row says it does no I/O is protocol-free too.
PROTOCOL_LIBRARIES = ("envoy", "google.protobuf", "grpc")


def covers(covered: str, path: str) -> bool:
    return path == covered or (covered.endswith("/") and path.startswith(covered))


def layer_of(path: str) -> str | None:
    """The row whose paths cover a file (relative to the repository root), or None. Where a folder's row
    and a row of one of its files both cover it (`extproc/protocol/` and `extproc/protocol/relay.py`), the
    more specific path wins."""
    best: tuple[int, str] | None = None
    for name, layer in layers().items():
        for covered in layer.paths:
            if covers(covered, path) and (best is None or len(covered) > best[0]):
                best = (len(covered), name)
    return None if best is None else best[1]


def row_named(path: str) -> str | None:
    """The row whose first cell names `path`, or None (then `path` is a single module of some row)."""
    return next((name for name, layer in layers().items() if path in layer.paths), None)


@functools.cache
def extproc_files() -> dict[str, str]:
    """Module name -> its path relative to the repository root, for every module of extproc/ but the package
    root (which holds only `__version__`)."""
    out: dict[str, str] = {}
    for path in sorted((ROOT / "extproc").rglob("*.py")):
        relative = path.relative_to(ROOT).as_posix()
        if relative == "extproc/__init__.py":
            continue
        out[module_name(path, ROOT)] = relative
    return out


def generated(path: str) -> bool:
    return path.endswith(("_pb2.py", "_pb2_grpc.py"))


def allowed(module: str, target: str) -> bool:
    """Whether extproc module `module` may import extproc module `target`."""
    files = extproc_files()
    layer = layer_of(files[module])
    target_path = files.get(target, "")
    target_layer = layer_of(target_path) if target != "extproc" else None
    if target == "extproc" or target_layer == layer:
        return True  # the package root holds only __version__; a row's modules import each other
    assert layer is not None, module
    for entry in (*layers()[layer].may_import, *everywhere()):
        row = row_named(entry)
        if (row is not None and row == target_layer) or (row is None and covers(entry, target_path)):
            return True
    return (module, target) in KNOWN_EXCEPTIONS


TOKEN = re.compile(r"`([^`]*)`|[()]")
MODULE = re.compile(r"[\w/]+\.py")


def names_in(cell: str) -> set[str]:
    """The `.py` modules a "holds" cell names, each as its path from the row's folder: within a parenthesis
    that follows a folder (`redis/` (`store.py`, ...)), from that folder."""
    named: set[str] = set()
    folders = [""]  # the folder each open parenthesis names from
    opening: str | None = None
    for token in TOKEN.finditer(cell):
        text = token.group(1)
        if text is None:
            if token.group(0) == "(":
                folders.append(opening if opening is not None else folders[-1])
            elif len(folders) > 1:
                folders.pop()
            opening = None
            continue
        follows = cell[token.end() :].lstrip().startswith("(")
        opening = folders[-1] + text if text.endswith("/") and follows else None
        if MODULE.fullmatch(text):
            named.add(text if text.startswith("extproc/") else folders[-1] + text)
    return named


def bases(layer: Layer) -> tuple[str, ...]:
    """The folders a row's names are read from: its folders, and the folder of each of its files."""
    return tuple(dict.fromkeys(p if p.endswith("/") else p.rsplit("/", 1)[0] + "/" for p in layer.paths))


def named_paths(layer: Layer) -> tuple[set[str], list[str]]:
    """The modules a row names, as paths from the repository root, and the names that resolve to none."""
    found: set[str] = set()
    missing: list[str] = []
    for name in sorted(names_in(layer.holds)):
        candidates = [name] if name.startswith("extproc/") else [base + name for base in bases(layer)]
        existing = [c for c in candidates if (ROOT / c).is_file()]
        found.update(existing)
        if not existing:
            missing.append(name)
    return found, missing


def test_the_table_is_read_whole() -> None:
    rows = layers()
    assert len(rows) > 15  # the parser found the table
    assert everywhere() == ("extproc/logs.py",)
    for row, layer in rows.items():
        assert layer.paths, f"{row}: its first cell names no path"
        for path in layer.paths:
            assert (ROOT / path).exists(), f"{row}: {path} does not exist"
        assert layer.io <= IO_WORDS, f"{row}: unknown I/O words {sorted(layer.io - IO_WORDS)}"
        for entry in layer.may_import:
            assert (ROOT / entry).exists() and layer_of(entry) is not None, f"{row}: may import {entry}?"


def test_every_extproc_module_belongs_to_a_layer() -> None:
    missing = [path for path in extproc_files().values() if layer_of(path) is None]
    assert missing == [], f"modules no row of docs/architecture.md's layer table covers: {missing}"


def test_every_module_a_row_names_exists() -> None:
    missing = {row: absent for row, layer in layers().items() if (absent := named_paths(layer)[1])}
    assert missing == {}, "names in the holds column that are no module (read from the row's folder)"


def test_every_module_of_a_folder_is_named_in_its_row() -> None:
    unnamed: dict[str, list[str]] = {}
    for row, layer in layers().items():
        named = named_paths(layer)[0]
        for folder in (path for path in layer.paths if path.endswith("/")):
            for file in sorted((ROOT / folder).rglob("*.py")):
                path = file.relative_to(ROOT).as_posix()
                if file.name in ("__init__.py", "__main__.py") or generated(path) or layer_of(path) != row:
                    continue
                if path not in named:
                    unnamed.setdefault(row, []).append(path)
    assert unnamed == {}, "modules their folder's row does not name (by the path from its folder)"


def test_every_import_follows_the_layer_rules() -> None:
    files = extproc_files()
    graph = import_graph(ROOT, "extproc")
    broken = [
        f"{module} ({layer_of(files[module])}) imports {target}"
        for module in sorted(files)
        for target in sorted(graph[module])
        if not allowed(module, target)
    ]
    assert broken == []


def test_the_known_exceptions_are_still_needed() -> None:
    """An exception whose import is gone is removed, so it cannot hide a new violation later."""
    graph = import_graph(ROOT, "extproc")
    seen = {(module, target) for module, targets in graph.items() for target in targets}
    assert set(KNOWN_EXCEPTIONS) <= seen, sorted(set(KNOWN_EXCEPTIONS) - seen)


def io_of(tree: ast.AST) -> set[str]:
    """The doc's I/O words for the I/O libraries a module imports."""
    imported = external_imports(tree)
    return {
        word
        for word, libraries in IO_LIBRARIES.items()
        for name in imported
        if any(name == lib or name.startswith(lib + ".") for lib in libraries)
    }


def test_every_module_does_only_the_io_its_row_names() -> None:
    broken: list[str] = []
    for module, path in extproc_files().items():
        layer = layer_of(path)
        assert layer is not None
        if generated(path):
            continue  # protoc's output: the gRPC stubs of a message package import grpc
        declared = layers()[layer].io
        tree = ast.parse((ROOT / path).read_text(encoding="utf-8"))
        if extra := io_of(tree) - declared:
            broken.append(f"{module}: {sorted(extra)} not in its row's I/O {sorted(declared)}")
        if not declared:
            protocol = sorted(
                name
                for name in external_imports(tree)
                if any(name == lib or name.startswith(lib + ".") for lib in PROTOCOL_LIBRARIES)
            )
            if protocol:
                broken.append(f"{module}: its row does no I/O, yet it imports {protocol}")
    assert broken == []


OUTSIDE_THE_PRODUCT = ("bench", "devstack", "tests")
"""Top-level packages of the repository that import extproc and that extproc never imports: the wheel and
the image ship extproc alone."""


def test_extproc_imports_neither_bench_nor_devstack_nor_tests() -> None:
    broken = [
        f"{module} imports {name}"
        for module, path in extproc_files().items()
        for name in external_imports(ast.parse((ROOT / path).read_text(encoding="utf-8")))
        if name.split(".")[0] in OUTSIDE_THE_PRODUCT
    ]
    assert broken == []


def test_no_import_cycle_in_extproc_or_bench() -> None:
    for package in ("extproc", "bench"):
        graph = import_graph(ROOT, package)
        assert len(graph) > 10, package  # the walk found the package
        for modules in CYCLE_EXCEPTIONS:
            if all(m.startswith(package + ".") for m in modules):
                for m in modules:  # break the known cycle at each of its edges inside the set
                    graph[m] = graph[m] - modules
        cycle = find_cycle(graph)
        assert cycle is None, " -> ".join(cycle or [])


def test_the_known_cycles_are_still_there() -> None:
    for modules in CYCLE_EXCEPTIONS:
        package = next(iter(modules)).split(".")[0]
        graph = import_graph(ROOT, package)
        sub = {m: graph[m] & modules for m in modules}
        assert find_cycle(sub) is not None, f"{sorted(modules)} no longer a cycle: remove the exception"


def test_a_rule_breach_is_caught() -> None:
    """Guard against a vacuous pass: an import the rules forbid is reported."""
    assert not allowed("extproc.core.limiter.limiter", "extproc.admission.exchange")
    assert not allowed("extproc.store.local", "extproc.config")
    assert not allowed("extproc.sim.server", "extproc.admission.exchange")
    assert allowed("extproc.sim.server", "extproc.admission.vocabulary.tokens")
    assert not allowed("extproc.protocol.lean", "extproc.config")
    assert allowed("extproc.core.limiter.limiter", "extproc.logs")  # every row may import it
    assert not allowed("extproc.logs", "extproc.core.clock")
    # A file's own row holds over its folder's: the relay may reach the store's port, the translators may not;
    # and nothing of the protocol reaches a store's own modules.
    assert layer_of("extproc/protocol/relay.py") == "`extproc/protocol/relay.py`"
    assert layer_of("extproc/protocol/lean.py") == "`extproc/protocol/`"
    assert allowed("extproc.protocol.relay", "extproc.core.ports")
    assert not allowed("extproc.protocol.lean", "extproc.core.ports")
    assert not allowed("extproc.protocol.relay", "extproc.store.redis.breaker")
    # The servicer depends on the interfaces it declares, not on the admission service's class.
    assert not allowed("extproc.protocol.servicer", "extproc.admission.service")
    # A row by its path is that row's modules only, not the rows of its files or subfolders.
    assert allowed("extproc.config.runtime", "extproc.kvfeed.subscriber.settings")
    assert not allowed("extproc.config.runtime", "extproc.kvfeed.subscriber.client")
    assert not allowed("extproc.kvfeed.exporter.app", "extproc.kvfeed.subscriber.client")
    assert io_of(ast.parse("import redis.asyncio\nfrom urllib.parse import quote\n")) == {"Redis"}


def test_the_holds_column_is_read_with_its_folders() -> None:
    cell = "`a.py` (job: `A`), `redis/` (shared: `store.py` (`S`) composes `x.py`), `b.py`, `extproc/c.py`"
    assert names_in(cell) == {"a.py", "redis/store.py", "redis/x.py", "b.py", "extproc/c.py"}
