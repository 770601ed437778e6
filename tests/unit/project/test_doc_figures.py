"""Every figure a doc quotes was measured where the project records measurements: bench/RESULTS.md (printed
from bench/results/) or a shipped config. A figure copied into a reference page goes stale when the benchmark
is rerun; this test finds it.

A *measured figure* is, narrowly: a number (or a range `a-b`) followed by a rate or CPU-time unit (`tok/s`,
`tokens/s`, `req/s`, `µs`); a latency after a statistic (`p50 2.1 ms`, `p99 0.75 s`, `mean 3 ms`); a share of
throughput (`99 % of the engine alone`, `% of one gateway`, `% of the best`). Design constants (`every 50 ms`,
`refused 50 ms before its deadline`) and alert thresholds are not figures by this definition. Each number of a
figure must appear in RESULTS.md with the same unit, in its prose or in a table column whose header names the
unit, or as a shipped config value whose key names the unit.

docs/internals/measurements.md is the one page that records figures measured by tests rather than by a
benchmark; its paragraphs that cite bench/RESULTS.md are held to the same rule."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.support.docs import README, REPO, without_fences

RESULTS = REPO / "bench" / "RESULTS.md"
MEASUREMENTS = REPO / "docs" / "internals" / "measurements.md"
CONFIGS = (
    *sorted((REPO / "config").glob("*.yaml")),
    *sorted((REPO / "k8s").rglob("*.yaml")),
    *sorted((REPO / "envoy").rglob("*.yaml")),
)
"""The shipped configs: the sidecar's, the manifests (alert rules included) and Envoy's."""
NUM = r"\d[\d,]*(?:\.\d+)?"
SPAN = rf"{NUM}(?:\s?[-\u2013]\s?{NUM})?"
FIGURE = re.compile(
    rf"(?<![\w.,/-])(?P<rate>{SPAN})\s?(?P<rate_unit>tok/s|tokens/s|req/s|µs)(?![\w/])"
    rf"|\b(?:p50|p90|p99|mean|median)\s(?P<lat>{SPAN})\s?(?P<lat_unit>ms|s)\b"
    rf"|(?<![\w.,/-])(?P<share>{SPAN})\s?%\sof\s(?=the engine|one gateway|the best)"
)
"""A measured figure, as the module docstring defines it."""
UNIT_IN_TEXT = re.compile(rf"(?<![\w.,/-])({SPAN})\s?(tok/s|tokens/s|req/s|µs|ms|s|%)(?![\w/])")
UNIT_IN_HEADER = re.compile(r"(tok/s|tokens/s|req/s|µs|ms|%)|\bs\b")
UNIT_IN_KEY = {"_ms": "ms", "_seconds": "s", "tokens_per_second": "tok/s", "requests_per_second": "req/s"}
DERIVED = {
    ("docs/planning.md", "8.30 req/s"): "the planner's arithmetic for its worked example, which "
    "tests/unit/plan/test_capacity.py holds step by step; a model, not a measurement",
}
"""Figures that look measured and are not, each with where it is held."""
Figure = tuple[float, str]


def unit(text: str) -> str:
    return {"tokens/s": "tok/s", "% of": "%"}.get(text, text)


def numbers(span: str) -> list[float]:
    return [float(n.replace(",", "")) for n in re.findall(NUM, span)]


def quoted(text: str) -> list[tuple[str, list[Figure]]]:
    """Each measured figure of a text: as written, and its numbers with their unit."""
    found = []
    for match in FIGURE.finditer(without_fences(text)):
        span = match["rate"] or match["lat"] or match["share"]
        kind = match["rate_unit"] or match["lat_unit"] or "%"
        found.append((match.group(0).strip(), [(n, unit(kind)) for n in numbers(span)]))
    return found


def recorded() -> set[Figure]:
    """The figures RESULTS.md records: numbers with a unit in its prose, and table cells under a header
    that names one."""
    text = without_fences(RESULTS.read_text())
    found = {(n, unit(u)) for span, u in UNIT_IN_TEXT.findall(text) for n in numbers(span)}
    header: list[str] = []
    for line in text.splitlines():
        if not line.startswith("|"):
            header = []
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if not header:
            header = cells
        elif not set(line) <= set("|-: "):
            for title, cell in zip(header, cells, strict=False):
                kind = UNIT_IN_HEADER.search(title)
                if kind:
                    found |= {(n, unit(kind.group(0))) for n in numbers(cell)}
    return found


def configured() -> set[Figure]:
    """The shipped configs' values whose key names a unit."""
    found = set()
    for path in CONFIGS:
        for key, value in re.findall(rf"(\w+):\s*({NUM})\b", path.read_text()):
            found |= {(float(value), u) for suffix, u in UNIT_IN_KEY.items() if key.endswith(suffix)}
    return found


def paragraphs_citing_results(text: str) -> str:
    return "\n\n".join(p for p in without_fences(text).split("\n\n") if "RESULTS.md" in p)


def unsourced(doc: str, text: str, sources: set[Figure]) -> list[str]:
    return [
        written
        for written, figures in quoted(text)
        if (doc, written) not in DERIVED and not all(figure in sources for figure in figures)
    ]


DOCS = [README, *(p for p in sorted((REPO / "docs").rglob("*.md")) if p != MEASUREMENTS)]


@pytest.fixture(scope="module")
def sources() -> set[Figure]:
    return recorded() | configured()


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_figure_a_doc_quotes_is_recorded(doc: Path, sources: set[Figure]) -> None:
    name = str(doc.relative_to(REPO))
    missing = unsourced(name, doc.read_text(), sources)
    assert not missing, f"{name} quotes figures neither bench/RESULTS.md nor a shipped config has: {missing}"


def test_the_measurements_page_quotes_results_as_recorded(sources: set[Figure]) -> None:
    text = paragraphs_citing_results(MEASUREMENTS.read_text())
    missing = unsourced("docs/internals/measurements.md", text, sources)
    assert not missing, f"docs/internals/measurements.md: not in bench/RESULTS.md: {missing}"


def test_a_stale_figure_is_caught(sources: set[Figure]) -> None:
    """The check itself: a figure RESULTS.md lacks fails, one it has passes, a constant is no figure."""
    assert unsourced("x.md", "the lean profile costs 12.34 µs per chunk", sources) == ["12.34 µs"]
    assert unsourced("x.md", "at 99 % of the engine alone, p99 0.75 s", sources) == []
    assert unsourced("x.md", "the pump runs every 100 ms; p99 9.99 ms", sources) == ["p99 9.99 ms"]
    assert quoted("a retry after 1 s, 50 ms before its deadline") == []
