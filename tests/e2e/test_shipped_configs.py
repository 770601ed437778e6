"""Every Envoy config the project ships passes the real Envoy 1.40 binary's validation.

The Istio EnvoyFilter is applied, patch by patch and as Istio applies each operation, to a bare gateway
bootstrap (one listener whose http_connection_manager has only a router, as istiod generates for a gateway),
and the result must validate: the merged HCM fields, the filter order and every typed config. The Kubernetes
gateway's bootstraps load their engine from a second file, so they are validated as `kubectl kustomize`
builds them, with that file (tests/e2e/test_upstream_e2e.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from devstack.envoy import render_envoy_config
from devstack.processes import Ports
from extproc.envoyconf.profiles import ENVOY_TEMPLATE, PROFILES
from tests.support.envoy_validate import validate
from tests.support.istio import ISTIO_FILTER, ISTIO_LEAN_FILTER, REPO, apply_envoy_filter, bare_gateway


@pytest.mark.parametrize(
    "path",
    [
        ENVOY_TEMPLATE,
        REPO / "envoy" / "envoy-lean.yaml",
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
