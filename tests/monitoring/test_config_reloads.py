"""Every outcome of a config file change is counted, so a refused edit shows on the dashboard and alerts.

A refused edit used to be logged only: the watcher caught the validation error before the sidecar's counter
saw it, so `extproc_config_reloads_total` only ever counted `applied`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from extproc.app import Sidecar
from extproc.config import Config, ConfigWatcher, ReloadResult, load_config
from extproc.metrics import Metrics

CONFIG: dict[str, Any] = {
    "server": {
        "grpc_listen": "127.0.0.1:0",
        "admin_listen": "127.0.0.1:0",
        "config_poll_seconds": 3600,  # the test calls check() itself
    },
    "limits": {"global": {"max_concurrency": 2}},
}


def write(path: Path, data: Any) -> None:
    path.write_text(yaml.safe_dump(data) if not isinstance(data, str) else data)


async def test_watcher_reports_every_outcome(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    write(path, CONFIG)
    results: list[ReloadResult] = []
    fail_next = False

    async def on_change(_config: Config) -> None:
        if fail_next:
            raise RuntimeError("store refused the limits")

    watcher = ConfigWatcher(path, on_change, 3600, on_result=results.append)
    assert await watcher.check() is False and results == []  # unchanged

    write(path, {**CONFIG, "limits": {"global": {"max_concurrency": -1}}})
    assert await watcher.check() is False
    write(path, "limits: [unclosed\n")
    assert await watcher.check() is False
    fail_next = True
    write(path, {**CONFIG, "limits": {"global": {"max_concurrency": 3}}})
    assert await watcher.check() is False
    fail_next = False
    path.unlink()
    assert await watcher.check() is False
    assert await watcher.check() is False  # still gone: reported once, not once per poll
    write(path, {**CONFIG, "limits": {"global": {"max_concurrency": 4}}})
    assert await watcher.check() is True

    assert results == [
        ReloadResult.REFUSED,
        ReloadResult.REFUSED,
        ReloadResult.FAILED,
        ReloadResult.UNREADABLE,
        ReloadResult.APPLIED,
    ]
    assert watcher.reloads == 1 and watcher.failures == 4


@pytest.fixture
async def sidecar(tmp_path: Path) -> AsyncIterator[Sidecar]:
    path = tmp_path / "config.yaml"
    write(path, CONFIG)
    sidecar = Sidecar(config=load_config(path), config_path=path, metrics=Metrics())
    await sidecar.start()
    try:
        yield sidecar
    finally:
        await sidecar.stop(grace_s=0)


def reloads(sidecar: Sidecar) -> dict[str, float]:
    registry = sidecar.metrics.registry
    out: dict[str, float] = {}
    for result in ReloadResult:
        value = registry.get_sample_value("extproc_config_reloads_total", {"result": result.value})
        assert value is not None, f"result={result.value} not exported"
        out[result.value] = value
    return out


async def test_sidecar_counts_each_reload_outcome_from_zero(
    sidecar: Sidecar, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert sidecar.watcher is not None and sidecar.config_path is not None
    path = sidecar.config_path
    # Exported at 0 before anything happens, so increase() over the first refusal is not lost.
    assert reloads(sidecar) == {"applied": 0, "refused": 0, "failed": 0, "unreadable": 0}

    write(path, {**CONFIG, "limits": {"global": {"max_concurrency": "many"}}})
    await sidecar.watcher.check()
    assert reloads(sidecar)["refused"] == 1
    assert sidecar.config.limits.global_.max_concurrency == 2

    async def broken(*_args: object) -> None:
        raise ConnectionError("store went away")

    assert sidecar.store is not None
    monkeypatch.setattr(sidecar.store, "apply_limits", broken)
    write(path, {**CONFIG, "limits": {"global": {"max_concurrency": 5}}})
    await sidecar.watcher.check()
    assert reloads(sidecar)["failed"] == 1
    assert sidecar.config.limits.global_.max_concurrency == 2
    monkeypatch.undo()

    path.unlink()
    await sidecar.watcher.check()
    write(path, {**CONFIG, "limits": {"global": {"max_concurrency": 6}}})
    await sidecar.watcher.check()
    assert reloads(sidecar) == {"applied": 1, "refused": 1, "failed": 1, "unreadable": 1}
    assert sidecar.config.limits.global_.max_concurrency == 6
