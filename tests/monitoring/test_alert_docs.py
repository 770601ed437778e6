"""docs/monitoring.md's alert table is the PrometheusRule's alerts: one row for each, at its severity, and
every alert carries the summary and the runbook (`description`) on-call reads. An outage once paged with an
alert whose runbook sent on-call to the wrong component (an engine down read as requests not forwarded), so a
new or renamed alert without its row and its runbook fails here; the rule tests under rules/ check what each
alert fires on."""

from __future__ import annotations

import re
from typing import Any

import pytest

from tests.monitoring.promtool import REPO, alert_names, rule_groups

MONITORING_DOC = REPO / "docs" / "monitoring.md"
ROW = re.compile(r"^\| `(?P<alert>Extproc\w+)` \| (?P<severity>\w+) \| (?P<fires>[^|]+) \|", re.MULTILINE)


def alert_rules() -> dict[str, dict[str, Any]]:
    return {rule["alert"]: rule for group in rule_groups() for rule in group["rules"] if "alert" in rule}


def doc_rows() -> dict[str, dict[str, str]]:
    """The alerts table's rows by alert; an alert given two rows fails."""
    rows: dict[str, dict[str, str]] = {}
    for match in ROW.finditer(MONITORING_DOC.read_text()):
        assert match["alert"] not in rows, f"{match['alert']}: two rows in docs/monitoring.md"
        rows[match["alert"]] = match.groupdict()
    return rows


def test_the_alert_table_has_one_row_per_alert() -> None:
    assert sorted(doc_rows()) == sorted(alert_names())


@pytest.mark.parametrize("alert", alert_names())
def test_each_row_gives_the_alerts_severity(alert: str) -> None:
    assert doc_rows()[alert]["severity"] == alert_rules()[alert]["labels"]["severity"]


@pytest.mark.parametrize("alert", alert_names())
def test_each_alert_carries_its_summary_and_runbook(alert: str) -> None:
    annotations = alert_rules()[alert].get("annotations", {})
    assert annotations.get("summary", "").strip(), f"{alert}: no summary"
    assert len(annotations.get("description", "").split()) >= 10, f"{alert}: no runbook in its description"


def test_the_overbooking_row_quotes_the_rules_usage_line_and_window() -> None:
    """ExtprocKvBudgetOverbooking is the alert for the failure the sidecar causes itself (kv_budget refusals
    with the cache nearly empty): the row's threshold and window are the rule's."""
    rule = alert_rules()["ExtprocKvBudgetOverbooking"]
    usage = r"max_over_time\(extproc_kv_usage_ratio\[(\d+)m\]\)\) < ([0-9.]+)"
    ((window, line),) = re.findall(usage, rule["expr"])
    fires = doc_rows()["ExtprocKvBudgetOverbooking"]["fires"]
    assert f"under {line}" in fires and f"{window} min" in fires, fires
    assert rule["for"] == f"{window}m"
