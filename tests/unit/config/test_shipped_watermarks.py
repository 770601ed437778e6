"""What docs/monitoring.md and the dashboard quote of the adaptive watermarks is what the shipped configs
set. The doc once quoted the defaults without a KV budget (0.70 / 0.85) while every shipped config runs the
budget with 0.92 / 0.98, so an operator read "healthy" and "overloaded" off lines the sidecar never acts on.
The values are read as the sidecar reads them (`load_file`), so a config that leaves them to their defaults
is held to the doc as well."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from extproc.config.load import load_file

REPO = Path(__file__).resolve().parents[3]
MONITORING_DOC = REPO / "docs" / "monitoring.md"
DASHBOARD = REPO / "k8s" / "monitoring" / "extproc-dashboard.json"
SHIPPED = sorted([*(REPO / "config").glob("*.yaml"), *(REPO / "k8s").rglob("config.yaml")])
"""Every sidecar config the project ships: the local stack's and each Kubernetes install's ConfigMap file."""
QUOTE = re.compile(r"\b(low|high) watermark \(([^)]*)\)")
"""Where the doc quotes a watermark: "low watermark (`adaptive.low_watermark`: 0.92 as shipped)"."""


def watermarks(path: Path) -> dict[str, float]:
    """The default watermarks the sidecar runs with under this config (`adaptive`, no pool override)."""
    adaptive = load_file(path).feedback.adaptive_default
    return {"low": adaptive.low_watermark, "high": adaptive.high_watermark}


@pytest.fixture(scope="module")
def shipped() -> dict[str, float]:
    """The one pair every shipped config runs with."""
    pairs = {path.relative_to(REPO).as_posix(): watermarks(path) for path in SHIPPED}
    assert {"config/local.yaml", "k8s/gateway/config.yaml"} <= set(pairs), sorted(pairs)
    distinct = {tuple(sorted(pair.items())) for pair in pairs.values()}
    assert len(distinct) == 1, f"the shipped configs disagree, the doc can quote only one pair: {pairs}"
    return next(iter(pairs.values()))


def test_the_monitoring_doc_quotes_the_shipped_watermarks(shipped: dict[str, float]) -> None:
    quotes = QUOTE.findall(MONITORING_DOC.read_text())
    assert {kind for kind, _ in quotes} == {"low", "high"}, quotes
    for kind, inside in quotes:
        numbers = [float(n) for n in re.findall(r"\d+\.\d+", inside)]
        assert numbers == [shipped[kind]], f"{kind} watermark quoted as ({inside}), shipped {shipped[kind]}"


def test_the_kv_usage_panel_draws_the_shipped_watermarks(shipped: dict[str, float]) -> None:
    dashboard: dict[str, Any] = json.loads(DASHBOARD.read_text())
    (panel,) = [p for p in dashboard["panels"] if p["title"] == "KV usage per pool"]
    defaults = panel["fieldConfig"]["defaults"]
    assert defaults["custom"]["thresholdsStyle"] == {"mode": "dashed"}
    lines = [step["value"] for step in defaults["thresholds"]["steps"]]
    assert lines == [None, shipped["low"], shipped["high"]]
    numbers = [float(n) for n in re.findall(r"\b0\.\d+", panel["description"])]
    assert numbers == [shipped["low"], shipped["high"]], panel["description"]
