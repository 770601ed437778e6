"""Istio's EnvoyFilter applied as istiod applies it, to a bare gateway bootstrap: what the shipped-config
validation and the edge tests run through a real Envoy."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

from extproc.envoyconf.profiles import ENVOY_TEMPLATE

REPO = Path(__file__).resolve().parents[2]
ISTIO_FILTER = REPO / "envoy" / "istio" / "envoyfilter.yaml"
ISTIO_LEAN_FILTER = REPO / "envoy" / "istio" / "envoyfilter-lean.yaml"
HCM = "envoy.filters.network.http_connection_manager"


def bare_gateway() -> dict[str, Any]:
    """What istiod gives a gateway before any EnvoyFilter: a listener, an HCM with a router, a route. As
    istiod 1.30 does by default: paths normalized (listener_builder.go, pathNormalization DEFAULT/BASE) and
    no route timeout (route.go setTimeout, Notimeout when the VirtualService sets none)."""
    router = {
        "name": "envoy.filters.http.router",
        "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"},
    }
    hcm = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3."
        "HttpConnectionManager",
        "stat_prefix": "outbound_0.0.0.0_8080",
        "normalize_path": True,
        "route_config": {
            "name": "http.8080",
            "virtual_hosts": [
                {
                    "name": "llm",
                    "domains": ["*"],
                    "routes": [
                        {"match": {"prefix": "/v1/"}, "route": {"cluster": "llm_upstream", "timeout": "0s"}}
                    ],
                }
            ],
        },
        "http_filters": [router],
    }
    upstream = copy.deepcopy(yaml.safe_load(ENVOY_TEMPLATE.read_text())["static_resources"]["clusters"][1])
    assert upstream["name"] == "llm_upstream"
    return {
        "static_resources": {
            "listeners": [
                {
                    "name": "0.0.0.0_8080",
                    "address": {"socket_address": {"address": "127.0.0.1", "port_value": 18080}},
                    "filter_chains": [{"filters": [{"name": HCM, "typed_config": hcm}]}],
                }
            ],
            "clusters": [upstream],
        }
    }


def merge(into: dict[str, Any], patch: dict[str, Any]) -> None:
    """Istio's MERGE: protobuf merge semantics (messages merge field by field, repeated fields append)."""
    for key, value in patch.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            merge(into[key], value)
        elif isinstance(value, list) and isinstance(into.get(key), list):
            into[key].extend(copy.deepcopy(value))
        else:
            into[key] = copy.deepcopy(value)


def apply_envoy_filter(bootstrap: dict[str, Any], patches: list[dict[str, Any]]) -> dict[str, Any]:
    out = copy.deepcopy(bootstrap)
    resources = out["static_resources"]
    listener = resources["listeners"][0]
    hcm_filter = listener["filter_chains"][0]["filters"][0]
    for patch in patches:
        kind, op, value = patch["applyTo"], patch["patch"]["operation"], patch["patch"]["value"]
        assert patch["match"]["context"] == "GATEWAY"
        filters = hcm_filter["typed_config"]["http_filters"]
        if (kind, op) == ("CLUSTER", "ADD"):
            resources["clusters"].append(copy.deepcopy(value))
        elif (kind, op) == ("LISTENER", "MERGE"):
            merge(listener, value)
        elif (kind, op) == ("NETWORK_FILTER", "MERGE"):
            assert value["name"] == HCM
            merge(hcm_filter, value)
        elif (kind, op) == ("HTTP_ROUTE", "MERGE"):
            name = patch["match"]["routeConfiguration"]["vhost"]["route"]["name"]
            vhosts = hcm_filter["typed_config"]["route_config"]["virtual_hosts"]
            routes = [r for vhost in vhosts for r in vhost["routes"] if r.get("name") == name]
            assert routes, f"no route named {name}"
            for route in routes:
                merge(route, value)
        elif (kind, op) == ("VIRTUAL_HOST", "MERGE"):
            for vhost in hcm_filter["typed_config"]["route_config"]["virtual_hosts"]:
                merge(vhost, value)
        elif (kind, op) == ("HTTP_FILTER", "INSERT_FIRST"):
            filters.insert(0, copy.deepcopy(value))
        elif (kind, op) == ("HTTP_FILTER", "INSERT_BEFORE"):
            anchor = patch["match"]["listener"]["filterChain"]["filter"]["subFilter"]["name"]
            filters.insert([f["name"] for f in filters].index(anchor), copy.deepcopy(value))
        else:
            raise AssertionError(f"no model of Istio's {op} on {kind}")
    return out
