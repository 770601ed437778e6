"""The inference-pool recipes (k8s/inference-pool/) put the sidecar before the endpoint picker and agree with
the pool they front.

Istio adds the picker's ext_proc filter, named `envoy.filters.http.ext_proc`, after the authn, authz and Wasm
filters of a Gateway API gateway that has an InferencePool attached (its HTTP connection manager builder
appends `xdsfilters.InferencePoolExtProc` when `HasInferencePool` holds for the gateway's
`gateway.networking.k8s.io/gateway-name` label; docs/gateways.md). The shipped Istio
EnvoyFilter inserts the sidecar's filter under that same name just before the router, which on such a gateway
means after the picker, and its per-route config would reach the picker too. The inference-pool variant,
rendered here from envoy/istio/envoyfilter-lean.yaml, names the sidecar's filter apart, inserts it before
the picker's, and selects the gateway by its Gateway API label (Istio attaches the picker only there).

Regenerate the shipped file with `python -m tests.unit.k8s.test_inference_pool`.
"""

from __future__ import annotations

import copy
from typing import Any

import yaml

from tests.unit.k8s.kustomize_build import K8S, REPO, built, named

LEAN_FILTER = REPO / "envoy" / "istio" / "envoyfilter-lean.yaml"
ISTIO_VARIANT = K8S / "inference-pool" / "istio" / "envoyfilter.yaml"
EXT_PROC = "envoy.filters.http.ext_proc"
SIDECAR_FILTER = "extproc.admission"
"""The sidecar's filter name behind Istio's picker: not Istio's `envoy.filters.http.ext_proc`, so neither
filter's per-route config (keyed by filter name) reaches the other."""
GATEWAY_LABEL = "gateway.networking.k8s.io/gateway-name"
GATEWAY = "llm-gateway"
HEADER = """\
# Rendered from envoy/istio/envoyfilter-lean.yaml by tests/unit/k8s/test_inference_pool.py (`python -m
# tests.unit.k8s.test_inference_pool`): do not edit. The lean Istio EnvoyFilter for a Gateway API gateway
# with an InferencePool attached (docs/gateways.md, "In front of an inference pool"). Differences from the
# source:
#   - the sidecar's ext_proc filter is named extproc.admission and inserted before Istio's picker filter
#     (envoy.filters.http.ext_proc), so the sidecar admits before the picker picks, and the route-level
#     config Istio writes for its picker reaches the picker only;
#   - the gateway is selected by its Gateway API label: Istio adds the picker's filter only to gateways it
#     deploys for a Gateway with an InferencePool. On a gateway without one there is no filter to insert
#     before and the sidecar would be missing: use envoy/istio/envoyfilter-lean.yaml there.
"""


def sidecar_patch(patches: list[dict[str, Any]]) -> dict[str, Any]:
    found = [p for p in patches if p["applyTo"] == "HTTP_FILTER" and p["patch"]["value"]["name"] == EXT_PROC]
    assert len(found) == 1, "the source inserts one ext_proc filter"
    return found[0]


def istio_variant(source: dict[str, Any]) -> dict[str, Any]:
    variant = copy.deepcopy(source)
    variant["spec"]["workloadSelector"] = {"labels": {GATEWAY_LABEL: GATEWAY}}
    patch = sidecar_patch(variant["spec"]["configPatches"])
    patch["match"]["listener"]["filterChain"]["filter"]["subFilter"]["name"] = EXT_PROC
    patch["patch"]["operation"] = "INSERT_BEFORE"
    patch["patch"]["value"]["name"] = SIDECAR_FILTER
    return variant


def rendered() -> str:
    return HEADER + yaml.safe_dump(istio_variant(yaml.safe_load(LEAN_FILTER.read_text())), sort_keys=False)


def test_the_istio_variant_is_the_rendering_of_the_lean_envoyfilter() -> None:
    assert ISTIO_VARIANT.read_text() == rendered()


def test_no_per_route_config_of_the_lean_source_is_keyed_by_the_pickers_name() -> None:
    """Renaming the filter would leave such config behind, on Istio's picker."""
    assert f"{EXT_PROC}:" not in LEAN_FILTER.read_text()


def test_envoy_gateway_runs_the_sidecar_before_the_picker_of_the_pool() -> None:
    docs = built(K8S / "inference-pool" / "envoy-gateway")
    pool = named(docs, "InferencePool", "vllm-pool")["spec"]
    sidecar, picker = named(docs, "EnvoyExtensionPolicy", "extproc-admission")["spec"]["extProc"]
    assert sidecar["backendRefs"] == [{"name": "extproc-admission", "port": 50051}]
    picker_ref = pool["endpointPickerRef"]
    assert picker["backendRefs"] == [{"name": picker_ref["name"], "port": picker_ref["port"]["number"]}]
    assert picker["failOpen"] is (picker_ref["failureMode"] == "FailOpen")
    service = named(docs, "Service", "vllm-pool")["spec"]
    assert service["selector"] == pool["selector"]["matchLabels"]
    assert [p["targetPort"] for p in service["ports"]] == [p["number"] for p in pool["targetPorts"]]
    route = named(docs, "HTTPRoute", "llm-routes")["spec"]["rules"][0]
    assert route["backendRefs"] == [{"name": "vllm-pool", "port": service["ports"][0]["port"]}]
    override = named(docs, "BackendTrafficPolicy", "extproc-endpoint-picker")["spec"]["loadBalancer"]
    assert override["endpointOverride"]["extractFrom"] == [{"header": "x-gateway-destination-endpoint"}]


def test_istio_routes_to_the_pool_its_picker_serves() -> None:
    docs = built(K8S / "inference-pool" / "istio")
    pool = named(docs, "InferencePool", "vllm-pool")
    route = named(docs, "HTTPRoute", "llm-routes")["spec"]
    assert route["parentRefs"] == [{"name": GATEWAY}]
    (backend,) = route["rules"][0]["backendRefs"]
    assert backend == {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "vllm-pool"}
    assert pool["metadata"]["namespace"] == "extproc"
    envoy_filter = named(docs, "EnvoyFilter", "extproc-admission")
    assert envoy_filter["metadata"]["namespace"] == "istio-system"


if __name__ == "__main__":
    print(rendered(), end="")
