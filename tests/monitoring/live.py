"""A real Prometheus next to the local stack, and the dashboard's queries with their variables filled in.

Used by the live dashboard test and by `scripts/record_dashboard_run.py` (the pictures in docs/img/).
"""

from __future__ import annotations

import json
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import yaml

from devstack.processes import free_port
from tests.monitoring.promtool import DASHBOARD, binary, write_rule_file


@dataclass(frozen=True)
class Target:
    """One dashboard query: the panel it feeds, its legend and its PromQL with Grafana variables."""

    panel: str
    legend: str
    expr: str


def dashboard_targets(dashboard_path: Path = DASHBOARD) -> list[Target]:
    dashboard = json.loads(dashboard_path.read_text())
    return [
        Target(panel["title"], target.get("legendFormat", ""), target["expr"])
        for panel in dashboard["panels"]
        if panel["type"] != "row"
        for target in panel["targets"]
    ]


def substitute(expr: str, variables: Mapping[str, str]) -> str:
    """Replace `$name` and `${name}` as Grafana does (longest names first: `$pool` never eats `$pools`)."""
    for name in sorted(variables, key=len, reverse=True):
        expr = expr.replace("${" + name + "}", variables[name]).replace("$" + name, variables[name])
    return expr


@dataclass
class Prometheus:
    """`prometheus` on a free localhost port scraping `jobs` (job name -> host:port) every `interval`,
    evaluating the PrometheusRule's groups. Start with `start()`, always `stop()`."""

    workdir: Path
    jobs: Mapping[str, str]
    interval: str = "1s"
    port: int = field(default_factory=free_port)
    popen: subprocess.Popen[bytes] | None = None
    log_file: IO[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 30.0) -> Prometheus:
        self.workdir.mkdir(parents=True, exist_ok=True)
        rules = write_rule_file(self.workdir / "extproc-rules.yaml")
        config = {
            "global": {"scrape_interval": self.interval, "evaluation_interval": self.interval},
            "rule_files": [str(rules)],
            "scrape_configs": [
                {"job_name": job, "static_configs": [{"targets": [address]}]}
                for job, address in self.jobs.items()
            ],
        }
        config_path = self.workdir / "prometheus.yml"
        config_path.write_text(yaml.safe_dump(config))
        self.log_file = open(self.workdir / "prometheus.log", "wb")  # noqa: SIM115 - lives with the process
        self.popen = subprocess.Popen(
            [
                binary("prometheus"),
                f"--config.file={config_path}",
                f"--storage.tsdb.path={self.workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--log.level=warn",
            ],
            stdin=subprocess.DEVNULL,
            stdout=self.log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self._wait_ready(timeout_s)
        return self

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.popen is not None
            if self.popen.poll() is not None:
                raise RuntimeError(f"prometheus exited with {self.popen.returncode}: {self.log()[-2000:]}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.1)
        raise TimeoutError(f"prometheus not ready after {timeout_s}s: {self.log()[-2000:]}")

    def log(self) -> str:
        path = self.workdir / "prometheus.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def api(self, path: str, **params: str) -> Any:
        query = urllib.parse.urlencode(params)
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=30) as resp:
            body = json.loads(resp.read())
        if body.get("status") != "success":
            raise AssertionError(f"{path} {params}: {body}")
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        params = {"query": expr} if at is None else {"query": expr, "time": f"{at:.3f}"}
        result: list[dict[str, Any]] = self.api("query", **params)["result"]
        return result

    def wait_for(self, expr: str, timeout_s: float) -> None:
        """Until the instant query `expr` returns a series (e.g. a comparison that holds)."""
        deadline = time.monotonic() + timeout_s
        while not self.query(expr):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{expr}: no result within {timeout_s}s")
            time.sleep(0.2)

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict[str, Any]]:
        data = self.api("query_range", query=expr, start=f"{start:.3f}", end=f"{end:.3f}", step=f"{step:g}")
        result: list[dict[str, Any]] = data["result"]
        return result

    def wait_scraped(self, jobs: int, timeout_s: float = 20.0) -> None:
        """Until every job's target has been scraped successfully at least once."""
        deadline = time.monotonic() + timeout_s
        while sum(float(s["value"][1]) for s in self.query("up")) < jobs:
            if time.monotonic() > deadline:
                raise TimeoutError(f"targets not up: {self.api('targets')}")
            time.sleep(0.2)

    def stop(self) -> None:
        if self.popen is not None and self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(5)
        if self.log_file is not None:
            self.log_file.close()
