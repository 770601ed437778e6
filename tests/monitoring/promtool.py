"""Shared helpers of the monitoring tests: the Prometheus binaries and the PrometheusRule's rule groups."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
MONITORING = REPO / "k8s" / "monitoring"
RULES = MONITORING / "prometheusrule.yaml"
DASHBOARD = MONITORING / "extproc-dashboard.json"


def binary(name: str) -> str:
    """Path of a Prometheus binary. Missing is a failure, never a skip: CI installs Debian's `prometheus`."""
    found = shutil.which(name) or (f"/usr/bin/{name}" if Path(f"/usr/bin/{name}").exists() else None)
    if found is None:
        raise AssertionError(
            f"{name} not found: install Debian's prometheus package (apt-get install prometheus)"
        )
    return found


def rule_groups() -> list[dict[str, Any]]:
    """The `spec.groups` of the PrometheusRule, i.e. a plain Prometheus rule file's `groups`."""
    doc = yaml.safe_load(RULES.read_text())
    assert doc["kind"] == "PrometheusRule"
    groups: list[dict[str, Any]] = doc["spec"]["groups"]
    return groups


def alert_names() -> list[str]:
    return [rule["alert"] for group in rule_groups() for rule in group["rules"] if "alert" in rule]


def write_rule_file(path: Path, summaries_only: bool = False) -> Path:
    """The rule groups as a Prometheus rule file. `summaries_only` drops the static `description`
    annotations, so unit tests check each alert's logic, labels and templated summary without repeating
    prose."""
    groups = rule_groups()
    if summaries_only:
        for group in groups:
            for rule in group["rules"]:
                rule.get("annotations", {}).pop("description", None)
    path.write_text(yaml.safe_dump({"groups": groups}, sort_keys=False))
    return path
