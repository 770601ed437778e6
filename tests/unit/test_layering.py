"""The layer table of docs/architecture.md holds in the code: every module of extproc/ belongs to one row,
imports only the layers its rule allows, uses no I/O library its row does not name, and neither extproc/
nor bench/ has an import cycle between modules.

The doc's table says what each package holds and which I/O it does; which layers each may import is `LAYERS`
below, checked row by row against the doc's table, so a row added, renamed or moved there fails here until
this table says where it sits. Dependencies point inward: the core imports nothing of the project, the
admission core and the stores only the core, the protocol layers the admission core, and the composition
(app, cli) everything. The local stack (devstack/), the benchmarks and the tests sit outside the product:
they import extproc, never the reverse. Where today's code breaks a rule the import is listed in
`KNOWN_EXCEPTIONS` with why; any other import across a rule fails.
"""

from __future__ import annotations

import ast
import functools
import re
from dataclasses import dataclass
from pathlib import Path

from tests.support.imports import external_imports, find_cycle, import_graph, module_name

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"
EVERYWHERE = frozenset({"logs"})  # JSON logging is allowed to every layer


@dataclass(frozen=True)
class Layer:
    """One layer: the doc row it sits in (its first cell, verbatim), the files or folders it covers, and what
    it may import: other layers by name, or single modules where only one of a layer's modules is allowed."""

    row: str
    paths: tuple[str, ...]
    may_import: frozenset[str]


def _layer(row: str, paths: tuple[str, ...], *may_import: str) -> Layer:
    return Layer(row, paths, frozenset(may_import) | EVERYWHERE)


_FEED_SIDES = "`extproc/kvfeed/exporter/`, `extproc/kvfeed/subscriber/`"
_METRICS = "`extproc/metrics.py`, `extproc/logs.py`"
_CLI = "`extproc/cli.py`, `extproc/__main__.py`"

LAYERS: dict[str, Layer] = {
    "core": _layer("`extproc/core/`", ("extproc/core/",)),
    "admission": _layer("`extproc/admission/`", ("extproc/admission/",), "core", "metrics"),
    "store": _layer("`extproc/store/`", ("extproc/store/",), "core"),
    "protocol": _layer("`extproc/protocol/`", ("extproc/protocol/",), "admission", "config"),
    "accesslog": _layer("`extproc/protocol/accesslog.py`", ("extproc/protocol/accesslog.py",), "admission"),
    "relay": _layer("`extproc/protocol/relay.py`", ("extproc/protocol/relay.py",), "store"),
    "envoyconf": _layer("`extproc/envoyconf/`", ("extproc/envoyconf/",), "admission", "config"),
    "app": _layer(
        "`extproc/app.py`",
        ("extproc/app.py",),
        *("accesslog", "admission", "config", "core", "metrics", "protocol", "subscriber"),
        *("relay", "store"),
    ),
    "cli": _layer(_CLI, ("extproc/cli.py", "extproc/__main__.py"), "app", "config", "envoyconf", "plan"),
    # The config package builds each package's own runtime types: admission's rules, the store's settings,
    # the feed subscriber's settings.
    "config": _layer(
        "`extproc/config/`",
        ("extproc/config/",),
        *("admission", "core", "kvfeed", "extproc.store.settings", "extproc.kvfeed.subscriber.settings"),
    ),
    "metrics": _layer(_METRICS, ("extproc/metrics.py",), "core"),
    "logs": _layer(_METRICS, ("extproc/logs.py",)),
    "kvfeed": _layer("`extproc/kvfeed/`", ("extproc/kvfeed/",)),
    "exporter": _layer(_FEED_SIDES, ("extproc/kvfeed/exporter/",), "kvfeed"),
    "subscriber": _layer(_FEED_SIDES, ("extproc/kvfeed/subscriber/",), "core", "kvfeed"),
    "geometry": _layer("`extproc/geometry/`", ("extproc/geometry/",)),
    "plan": _layer("`extproc/plan/`", ("extproc/plan/",), "core", "geometry", "sim"),
    # The simulator counts tokens as the sidecar does; nothing else of the admission core.
    "sim": _layer("`extproc/sim/`", ("extproc/sim/",), "geometry", "extproc.admission.tokens"),
}

# Imports that break a rule today, each (importing module, imported layer or module) with why. The test
# fails on any other; remove an entry when the import goes. None is left: add one only with its reason.
KNOWN_EXCEPTIONS: dict[tuple[str, str], str] = {}

# Import cycles between modules that exist today, each as its set of modules. The one left is a
# function-level (deferred) import, which still makes the two modules depend on each other.
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


@dataclass(frozen=True)
class DocRow:
    paths: tuple[str, ...]
    io: frozenset[str]


def doc_rows(text: str) -> dict[str, DocRow]:
    """The rows of the table under `## Layers`: first cell -> the paths it names and the I/O words."""
    section = text.split("\n## Layers\n", 1)[1].split("\n## ", 1)[0]
    rows: dict[str, DocRow] = {}
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if not line.startswith("|") or len(cells) != 3 or cells[0] in ("package", "---"):
            continue
        paths = tuple(re.findall(r"`(extproc/[^`]*)`", cells[0]))
        # "none" and an en dash both say the row does no I/O.
        io = frozenset(word.strip() for word in cells[2].split(",")) - {"none", "\u2013"}
        rows[cells[0]] = DocRow(paths, io)
    return rows


def layer_of(path: str) -> str | None:
    """The layer whose paths cover a file (relative to the repository root), or None. Where a folder's row
    and a row of one of its files both cover it (`extproc/protocol/` and `extproc/protocol/relay.py`), the
    more specific path wins."""
    best: tuple[int, str] | None = None
    for name, layer in LAYERS.items():
        for covered in layer.paths:
            covers = path == covered or (covered.endswith("/") and path.startswith(covered))
            if covers and (best is None or len(covered) > best[0]):
                best = (len(covered), name)
    return None if best is None else best[1]


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


def allowed(module: str, layer: str, target: str) -> bool:
    """Whether `module` (of `layer`) may import `target`, an extproc module."""
    target_layer = layer_of(extproc_files().get(target, "")) if target != "extproc" else None
    if target == "extproc" or target_layer == layer:
        return True  # the package root holds only __version__; a layer's modules import each other
    rule = LAYERS[layer].may_import
    if target_layer in rule or any(target == m or target.startswith(m + ".") for m in rule if "." in m):
        return True
    return (module, str(target_layer)) in KNOWN_EXCEPTIONS or (module, target) in KNOWN_EXCEPTIONS


def test_the_rules_cover_the_doc_table_row_by_row() -> None:
    rows = doc_rows(DOC.read_text(encoding="utf-8"))
    assert len(rows) > 10  # the parser found the table
    by_row: dict[str, set[str]] = {}
    for layer in LAYERS.values():
        by_row.setdefault(layer.row, set()).update(layer.paths)
    assert set(by_row) == set(rows), "rows in the doc or in LAYERS only"
    for row, doc in rows.items():
        assert set(doc.paths) == by_row[row], row
        assert doc.io <= IO_WORDS, f"{row}: unknown I/O words {sorted(doc.io - IO_WORDS)}"


def test_every_extproc_module_belongs_to_a_layer() -> None:
    missing = [path for path in extproc_files().values() if layer_of(path) is None]
    assert missing == [], f"modules no row of docs/architecture.md's layer table covers: {missing}"


def test_every_import_follows_the_layer_rules() -> None:
    files = extproc_files()
    graph = import_graph(ROOT, "extproc")
    broken = [
        f"{module} ({layer_of(files[module])}) imports {target}"
        for module in sorted(files)
        for target in sorted(graph[module])
        if not allowed(module, str(layer_of(files[module])), target)
    ]
    assert broken == []


def test_the_known_exceptions_are_still_needed() -> None:
    """An exception whose import is gone is removed, so it cannot hide a new violation later."""
    files = extproc_files()
    graph = import_graph(ROOT, "extproc")
    seen = {
        (module, str(layer_of(files.get(target, ""))))
        for module in files
        for target in graph[module]
        if target in files
    }
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
    rows = doc_rows(DOC.read_text(encoding="utf-8"))
    broken: list[str] = []
    for module, path in extproc_files().items():
        layer = layer_of(path)
        assert layer is not None
        if generated(path):
            continue  # protoc's output: the gRPC stubs of a message package import grpc
        declared = rows[LAYERS[layer].row].io
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
    assert not allowed("extproc.core.limiter", "core", "extproc.admission.exchange")
    assert not allowed("extproc.store.local", "store", "extproc.config")
    assert not allowed("extproc.sim.server", "sim", "extproc.admission.exchange")
    assert allowed("extproc.sim.server", "sim", "extproc.admission.tokens")
    # A file's own row holds over its folder's: the relay may reach the store, the translators may not.
    assert layer_of("extproc/protocol/relay.py") == "relay"
    assert layer_of("extproc/protocol/lean.py") == "protocol"
    assert allowed("extproc.protocol.relay", "relay", "extproc.store.redis.breaker")
    assert not allowed("extproc.protocol.lean", "protocol", "extproc.store.redis.breaker")
    assert io_of(ast.parse("import redis.asyncio\nfrom urllib.parse import quote\n")) == {"Redis"}
