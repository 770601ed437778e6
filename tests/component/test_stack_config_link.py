"""`python -m devstack --config PATH` watches PATH as given, so a ConfigMap-style symlink swap is seen.

A ConfigMap volume holds `config.yaml -> ..data/config.yaml` and `..data -> ..<timestamp>`; the kubelet
updates it by pointing `..data` at a new directory. A stack that resolved the path once would hand the
sidecar the old directory's file, which never changes. The sidecar here is started with the exact command
line the stack builds, and the swap must reach it.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import yaml

from devstack.processes import Ports, Process, wait_http
from devstack.run import foreground_stack
from devstack.stack import sidecar_config_with_ports
from tests.support.stack import build_stack, metric


def configmap_version(volume: Path, name: str, config: dict[str, Any]) -> None:
    """Write a new `..<name>` directory and swap `..data` to it atomically, as the kubelet does."""
    version = volume / f"..{name}"
    version.mkdir()
    (version / "config.yaml").write_text(yaml.safe_dump(config))
    staged = volume / "..data_tmp"
    staged.symlink_to(version.name)
    os.replace(staged, volume / "..data")


def test_make_run_passes_the_config_path_unresolved(tmp_path: Path) -> None:
    volume = tmp_path / "etc-extproc"
    volume.mkdir()
    configmap_version(volume, "2026_01_01", {})
    link = volume / "config.yaml"
    link.symlink_to("..data/config.yaml")
    stack = foreground_stack(link)
    assert stack.config_path == link
    assert stack.sidecar_argv()[-2:] == ["--config", str(link)]
    # A relative path becomes absolute (the processes run from the repository root), still unresolved.
    relative = Path(os.path.relpath(link))
    assert foreground_stack(relative).config_path == Path.cwd() / relative


def test_sidecar_started_by_the_stack_sees_a_configmap_swap(tmp_path: Path) -> None:
    ports = Ports.free()
    volume = tmp_path / "etc-extproc"
    volume.mkdir()

    def config(max_concurrency: int) -> dict[str, Any]:
        base = {
            "server": {"config_poll_seconds": 0.1},
            "limits": {"global": {"max_concurrency": max_concurrency}},
        }
        return sidecar_config_with_ports(base, ports)

    configmap_version(volume, "2026_01_01", config(7))
    link = volume / "config.yaml"
    link.symlink_to("..data/config.yaml")
    workdir = tmp_path / "work"
    workdir.mkdir()
    stack = build_stack(ports=ports, sidecar_config_file=link, workdir=workdir, envoy_patch=None)
    sidecar = Process.start("sidecar", stack.sidecar_argv(), workdir)
    try:
        wait_http(f"{stack.admin_url}/readyz", proc=sidecar)
        limit = f"{stack.admin_url}/metrics"
        assert metric(limit, "extproc_limit_concurrency", key="global") == 7
        configmap_version(volume, "2026_01_02", config(11))
        deadline = time.monotonic() + 20
        while metric(limit, "extproc_limit_concurrency", key="global") != 11:
            assert time.monotonic() < deadline, sidecar.log()[-2000:]
            time.sleep(0.1)
        assert metric(limit, "extproc_config_reloads_total") >= 1
    finally:
        sidecar.stop()
