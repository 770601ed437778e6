"""The Grafana dashboard is importable as written and every query names series that really exist.

Targets Grafana's classic dashboard JSON model at schemaVersion 41: `LATEST_VERSION = 41` in
grafana/grafana apps/dashboard/pkg/migration/schemaversion/migrations.go (commit 7501ffa; 42 from commit
01ec8e3, which migrates any version from 9 up on load, so a 41 dashboard loads on later releases too).
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
import yaml

from tests.monitoring.exported import exported_series, series_in
from tests.monitoring.promtool import DASHBOARD, MONITORING, rule_groups

BUILTIN_VARIABLES = {"__rate_interval", "__interval", "__range"}
VARIABLE = re.compile(r"\$\{?(\w+)")
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
# The panels the dashboard exists for (issue 13, and the exporter's page bound), by title.
REQUIRED_PANELS = {
    "Admitted vs refused",
    "Refused by reason",
    "Active leases vs limit",
    "Tokens-per-minute remaining",
    "Adaptive scale",
    "KV usage per pool",
    "KV usage per node",
    "KV budget headroom",
    "KV budget refusals vs KV usage",
    "Queue depth",
    "Queue wait",
    "Settlement outcomes",
    "Tokens reserved, refunded, overrun",
    "Decision latency",
    "Feed staleness",
    "Store errors",
    "Config reloads",
    "Exporter page size",
}


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return data


def panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for p in dashboard["panels"] if p["type"] != "row"]


def targets(dashboard: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    return [(p["title"], t) for p in panels(dashboard) for t in p["targets"]]


def test_model_fields_and_variables(dashboard: dict[str, Any]) -> None:
    assert dashboard["schemaVersion"] == 41
    assert dashboard["id"] is None and dashboard["uid"] == "extproc-admission"
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for name, label in (("pool", "model"), ("class", "class")):
        var = variables[name]
        assert var["type"] == "query" and var["datasource"] == DATASOURCE
        assert var["query"]["query"] == var["definition"]
        assert var["definition"].startswith("label_values(") and var["definition"].endswith(f", {label})")
        assert var["includeAll"] and var["multi"] and var["allValue"] == ".*"


def test_every_query_uses_the_datasource_variable_and_defined_variables(dashboard: dict[str, Any]) -> None:
    defined = {v["name"] for v in dashboard["templating"]["list"]} | BUILTIN_VARIABLES
    for panel in panels(dashboard):
        assert panel["datasource"] == DATASOURCE, panel["title"]
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids)) and ref_ids, panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == DATASOURCE, panel["title"]
            used = set(VARIABLE.findall(target["expr"]))
            assert used <= defined, f"{panel['title']}: undefined {used - defined}"


def test_layout_ids_unique_and_panels_do_not_overlap(dashboard: dict[str, Any]) -> None:
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for panel in dashboard["panels"]:
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24, panel["title"]
        mine = {
            (x, y) for x in range(pos["x"], pos["x"] + pos["w"]) for y in range(pos["y"], pos["y"] + pos["h"])
        }
        assert not mine & cells, f"{panel['title']} overlaps another panel"
        cells |= mine


def test_every_required_panel_is_there(dashboard: dict[str, Any]) -> None:
    titles = {p["title"] for p in panels(dashboard)}
    assert titles >= REQUIRED_PANELS, REQUIRED_PANELS - titles


def test_every_series_named_by_the_dashboard_and_the_alerts_is_exported(dashboard: dict[str, Any]) -> None:
    """A misspelt metric would show an empty panel or an alert that can never fire."""
    exported = exported_series()
    for title, target in targets(dashboard):
        missing = series_in(target["expr"]) - exported
        assert not missing, f"dashboard panel {title!r}: {missing}"
    for group in rule_groups():
        for rule in group["rules"]:
            missing = series_in(rule["expr"]) - exported
            assert not missing, f"alert {rule['alert']}: {missing}"


def test_kustomize_ships_the_dashboard_to_the_grafana_sidecar() -> None:
    spec = yaml.safe_load((MONITORING / "kustomization.yaml").read_text())
    (generator,) = [g for g in spec["configMapGenerator"] if g["name"] == "extproc-dashboard"]
    assert generator["files"] == [DASHBOARD.name]
    assert generator["options"]["labels"]["grafana_dashboard"] == "1"
    assert generator["options"]["disableNameSuffixHash"] is True


def test_the_overbooking_panel_draws_the_alerts_usage_line(dashboard: dict[str, Any]) -> None:
    """The dashed line of "KV budget refusals vs KV usage" is where ExtprocKvBudgetOverbooking fires: refusals
    under it page someone, so the two must not drift apart."""
    (rule,) = [r for g in rule_groups() for r in g["rules"] if r.get("alert") == "ExtprocKvBudgetOverbooking"]
    (line,) = re.findall(r"max_over_time\(extproc_kv_usage_ratio\[10m\]\)\) < ([0-9.]+)", rule["expr"])
    (panel,) = [p for p in panels(dashboard) if p["title"] == "KV budget refusals vs KV usage"]
    defaults = panel["fieldConfig"]["defaults"]
    assert defaults["custom"]["thresholdsStyle"] == {"mode": "dashed"}
    assert [step["value"] for step in defaults["thresholds"]["steps"]] == [None, float(line)]
