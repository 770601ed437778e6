"""`envoy --mode validate` on a config, as the real Envoy 1.40 binary of the dev extras judges it."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import yaml

from devstack.processes import envoy_binary


def validate(config: dict[str, Any] | Path, tmp_path: Path) -> None:
    """Fail with Envoy's own words unless it accepts `config` (a file, or a dict written under tmp_path)."""
    if isinstance(config, Path):
        path = config
    else:
        path = tmp_path / "envoy.yaml"
        path.write_text(yaml.safe_dump(config))
    result = subprocess.run(
        [envoy_binary(), "--mode", "validate", "-c", str(path), "--base-id", "77"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "OK" in result.stdout
