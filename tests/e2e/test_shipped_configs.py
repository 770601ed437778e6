"""Every Envoy config the project ships passes the real Envoy 1.40 binary's validation."""

from __future__ import annotations

import copy
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from extproc.stack import ENVOY_TEMPLATE, envoy_binary

REPO = Path(__file__).resolve().parents[2]


def validate(config: dict[str, Any] | Path, tmp_path: Path) -> None:
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


@pytest.mark.parametrize(
    "path", [ENVOY_TEMPLATE, REPO / "k8s" / "gateway" / "envoy.yaml"], ids=lambda p: p.name
)
def test_envoy_bootstraps_validate(path: Path, tmp_path: Path) -> None:
    validate(path, tmp_path)


def test_istio_envoyfilter_fragments_validate(tmp_path: Path) -> None:
    """The EnvoyFilter's cluster and filter, placed into a static bootstrap, are valid Envoy config."""
    patches = yaml.safe_load((REPO / "envoy" / "istio" / "envoyfilter.yaml").read_text())["spec"][
        "configPatches"
    ]
    cluster = next(p["patch"]["value"] for p in patches if p["applyTo"] == "CLUSTER")
    ext_proc = next(p["patch"]["value"] for p in patches if p["applyTo"] == "HTTP_FILTER")
    config = yaml.safe_load(ENVOY_TEMPLATE.read_text())
    bootstrap = copy.deepcopy(config)
    resources = bootstrap["static_resources"]
    resources["clusters"] = [c for c in resources["clusters"] if c["name"] != cluster["name"]] + [cluster]
    hcm = resources["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    hcm["http_filters"] = [
        ext_proc if f["name"] == "envoy.filters.http.ext_proc" else f for f in hcm["http_filters"]
    ]
    validate(bootstrap, tmp_path)
