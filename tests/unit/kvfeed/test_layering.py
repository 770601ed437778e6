"""Import layering of the KV feed: config loads without network libraries, and the exporter (node side)
and the subscriber (sidecar side) meet only in the shared top of `extproc.kvfeed`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.support import imports

ROOT = Path(__file__).resolve().parents[3]


def import_graph() -> dict[str, set[str]]:
    return imports.import_graph(ROOT, "extproc")


def in_package(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def reaches(graph: dict[str, set[str]], start: str, target_package: str) -> list[str] | None:
    """A chain of imports from `start` into `target_package`, or None."""
    seen = {start}
    stack = [[start]]
    while stack:
        chain = stack.pop()
        for nxt in sorted(graph.get(chain[-1], ())):
            if in_package(nxt, target_package):
                return [*chain, nxt]
            if nxt not in seen:
                seen.add(nxt)
                stack.append([*chain, nxt])
    return None


def test_graph_sees_the_real_imports() -> None:
    """Guard against a vacuous pass: the walker must find edges that are known to exist."""
    graph = import_graph()
    assert "extproc.kvfeed.sample" in graph["extproc.kvfeed.exporter.hub"]
    assert "extproc.kvfeed.subscriber.settings" in graph["extproc.config.build"]


def test_feedback_and_exporter_do_not_import_each_other() -> None:
    graph = import_graph()
    pairs = (
        ("extproc.kvfeed.subscriber", "extproc.kvfeed.exporter"),
        ("extproc.kvfeed.exporter", "extproc.kvfeed.subscriber"),
    )
    for module in graph:
        for side, other in pairs:
            if in_package(module, side):
                chain = reaches(graph, module, other)
                assert chain is None, f"{side} reaches {other}: {' -> '.join(chain or [])}"


def test_shared_feed_package_imports_neither_side() -> None:
    graph = import_graph()
    sides = ("extproc.kvfeed.subscriber", "extproc.kvfeed.exporter")
    shared = [
        m for m in graph if in_package(m, "extproc.kvfeed") and not any(in_package(m, s) for s in sides)
    ]
    assert "extproc.kvfeed.sample" in shared and "extproc.kvfeed.proto.feedback_pb2" in shared
    for module in shared:
        for other in (*sides, "extproc.config"):
            chain = reaches(graph, module, other)
            assert chain is None, f"{module} reaches {other}: {' -> '.join(chain or [])}"


def test_config_imports_no_io_package() -> None:
    code = (
        "import sys, extproc.config\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('aiohttp', 'grpc', 'redis'))\n"
        "print(','.join(bad))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT, check=True
    )
    assert proc.stdout.strip() == "", f"extproc.config pulls in I/O packages: {proc.stdout.strip()}"
