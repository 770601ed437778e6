"""Every Envoy config the project ships passes the real Envoy 1.40 binary's validation.

The Istio EnvoyFilter is applied, patch by patch and as Istio applies each operation, to a bare gateway
bootstrap (one listener whose http_connection_manager has only a router, as istiod generates for a gateway),
and the result must validate: the merged HCM fields, the filter order and every typed config; so must the
inference pool's retry patch, merged into the route istiod builds for the pool's HTTPRoute. The Kubernetes
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

POOL_ROUTES = REPO / "k8s" / "inference-pool" / "istio" / "routes"


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


def test_istio_pool_route_retry_patch_applied_to_a_gateway_validates(tmp_path: Path) -> None:
    """k8s/inference-pool/istio's retry patch MERGEd into the route istiod builds for the HTTPRoute's rule:
    named after the rule, with istiod's default retry policy (istio/istio 1.30.3, route/retry/retry.go)."""
    (rule,) = yaml.safe_load((POOL_ROUTES / "httproute.yaml").read_text())["spec"]["rules"]
    gateway = bare_gateway()
    hcm = gateway["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    (route,) = hcm["route_config"]["virtual_hosts"][0]["routes"]
    route["name"] = rule["name"]
    route["route"]["retry_policy"] = {
        "retry_on": "connect-failure,refused-stream,unavailable,cancelled,retriable-status-codes",
        "num_retries": 2,
        "host_selection_retry_max_attempts": 5,
        "retry_host_predicate": [
            {
                "name": "envoy.retry_host_predicates.previous_hosts",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.retry.host.previous_hosts.v3."
                    "PreviousHostsPredicate"
                },
            }
        ],
    }
    patches = yaml.safe_load((POOL_ROUTES / "engine-retry.yaml").read_text())["spec"]["configPatches"]
    patched = apply_envoy_filter(gateway, patches)
    hcm = patched["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    policy = hcm["route_config"]["virtual_hosts"][0]["routes"][0]["route"]["retry_policy"]
    assert (policy["retry_on"], policy["num_retries"]) == ("reset-before-request", 1)
    validate(patched, tmp_path)
