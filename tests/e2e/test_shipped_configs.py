"""Every Envoy config the project ships passes the real Envoy 1.40 binary's validation.

The Istio EnvoyFilter is applied, patch by patch and as Istio applies each operation, to a bare gateway
bootstrap (one listener whose http_connection_manager has only a router, as istiod generates for a gateway),
and the result must validate: the merged HCM fields, the filter order and every typed config.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from devstack.envoy import render_envoy_config
from devstack.processes import Ports, envoy_binary
from extproc.envoyconf.profiles import ENVOY_TEMPLATE, PROFILES
from tests.support.istio import ISTIO_FILTER, ISTIO_LEAN_FILTER, REPO, apply_envoy_filter, bare_gateway


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
    "path",
    [
        ENVOY_TEMPLATE,
        REPO / "envoy" / "envoy-lean.yaml",
        REPO / "k8s" / "gateway" / "envoy.yaml",
        REPO / "k8s" / "gateway" / "lean" / "envoy.yaml",
    ],
    ids=lambda p: str(p.relative_to(REPO)),
)
def test_envoy_bootstraps_validate(path: Path, tmp_path: Path) -> None:
    validate(path, tmp_path)


@pytest.mark.parametrize("profile", PROFILES)
def test_stack_rendering_with_a_custom_tenant_header_validates(profile: str, tmp_path: Path) -> None:
    validate(render_envoy_config(Ports.free(), tenant_header="X-Org-Id", profile=profile), tmp_path)


def test_istio_envoyfilter_applied_to_a_gateway_validates(tmp_path: Path) -> None:
    patches = yaml.safe_load(ISTIO_FILTER.read_text())["spec"]["configPatches"]
    gateway = apply_envoy_filter(bare_gateway(), patches)
    hcm = gateway["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    assert [f["name"] for f in hcm["http_filters"]] == [
        "envoy.filters.http.header_mutation",
        "envoy.filters.http.ext_proc",
        "envoy.filters.http.router",
    ]
    validate(gateway, tmp_path)


def test_istio_lean_envoyfilter_applied_to_a_gateway_validates(tmp_path: Path) -> None:
    patches = yaml.safe_load(ISTIO_LEAN_FILTER.read_text())["spec"]["configPatches"]
    gateway = apply_envoy_filter(bare_gateway(), patches)
    hcm = gateway["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    assert [f["name"] for f in hcm["http_filters"]] == [
        "envoy.filters.http.header_mutation",
        "envoy.filters.http.ext_proc",
        "envoy.filters.http.lua",
        "envoy.filters.http.router",
    ]
    validate(gateway, tmp_path)
