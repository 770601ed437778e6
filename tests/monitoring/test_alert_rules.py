"""The PrometheusRule's alerts, checked and unit-tested by the real promtool (Debian's prometheus 2.42).

`rules/<alert>.yaml` holds one `promtool test rules` file per alert, each with a case where the alert fires
and cases where it must not. The rule groups are extracted from the PrometheusRule into a plain rule file
next to a copy of the test file, which names it `extproc-rules.yaml`.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.monitoring.promtool import alert_names, binary, write_rule_file

HERE = Path(__file__).resolve().parent
UNIT_TESTS = sorted((HERE / "rules").glob("*.yaml"))
RULE_FILE = "extproc-rules.yaml"


def run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)


def test_rules_pass_promtool_check(tmp_path: Path) -> None:
    rules = write_rule_file(tmp_path / RULE_FILE)
    result = run(binary("promtool"), "check", "rules", str(rules))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(alert_names())} rules found" in result.stdout


def expected_alerts(spec: dict[str, Any]) -> tuple[set[str], set[str]]:
    """(alerts expected to fire somewhere, alerts expected silent somewhere) in one unit-test file."""
    firing: set[str] = set()
    silent: set[str] = set()
    for test in spec["tests"]:
        for case in test.get("alert_rule_test", []):
            (firing if case.get("exp_alerts") else silent).add(case["alertname"])
    return firing, silent


def test_every_alert_has_one_unit_test_file_with_firing_and_silent_cases() -> None:
    covered: dict[str, Path] = {}
    for path in UNIT_TESTS:
        spec = yaml.safe_load(path.read_text())
        assert spec["rule_files"] == [RULE_FILE], path
        firing, silent = expected_alerts(spec)
        assert len(firing | silent) == 1, f"{path.name}: one alert per file, got {sorted(firing | silent)}"
        assert firing == silent, f"{path.name}: needs a firing and a silent case"
        (alert,) = firing
        assert alert not in covered, f"{alert} tested in {covered.get(alert)} and {path}"
        covered[alert] = path
    assert sorted(covered) == sorted(alert_names())


@pytest.mark.parametrize("unit_test", UNIT_TESTS, ids=[p.stem for p in UNIT_TESTS])
def test_alert_unit_test(unit_test: Path, tmp_path: Path) -> None:
    write_rule_file(tmp_path / RULE_FILE, summaries_only=True)
    shutil.copy(unit_test, tmp_path / unit_test.name)
    result = run(binary("promtool"), "test", "rules", str(tmp_path / unit_test.name))
    assert result.returncode == 0, result.stdout + result.stderr
