"""Every shipped Envoy config closes an idle engine connection before the engine does, and retries a request
only while none of it has reached the engine (envoy/envoy.yaml's header: Engine keep-alive, Retries).

The walk: the plain-Envoy bootstraps (envoy/, their lean renderings, the local stack's renderings), every
Kubernetes build's gateway pod (its bootstrap, and the engine cluster of the CDS file it mounts), Envoy
Gateway's BackendTrafficPolicies as they apply to each HTTPRoute of its Gateway, and the Istio EnvoyFilters
(which define no engine route or cluster: under Istio those are the operator's, docs/gateways.md). A shipped
file of Envoy config that the walk does not reach fails the last test. That Envoy runs these settings as
meant (the idle close, a retry of a failed connect, none of a request the engine read) is
tests/e2e/test_engine_connections_e2e.py.
"""

from __future__ import annotations

import re
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import yaml

from devstack.envoy import render_envoy_config
from devstack.processes import Ports
from extproc.envoyconf.bootstrap import http_connection_managers
from extproc.envoyconf.profiles import ENVOY_TEMPLATE, PROFILES
from extproc.envoyconf.upstream import EngineAddress, clusters_of, upstream_cluster
from tests.support.keepalive import ENGINE_KEEP_ALIVE_S
from tests.unit.k8s.kustomize_build import K8S, REPO, built, envoy_files, roots

RETRY_ON = "reset-before-request"
"""The one retry condition: Envoy retries a reset only while no request byte went upstream (router.cc,
`first_upstream_tx_byte_sent_`), so no prompt runs twice. `reset`, `5xx`, `gateway-error` would replay one."""
MAX_RETRIES = 2
HTTP_OPTIONS = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
SIDECAR_CLUSTER = "llm_admission_extproc"
ISTIO_FILTERS = sorted((REPO / "envoy" / "istio").glob("*.yaml"))
PLAIN_BOOTSTRAPS = [ENVOY_TEMPLATE, REPO / "envoy" / "envoy-lean.yaml"]


def seconds(duration: str) -> float:
    """An Envoy duration (`4s`, `0.5s`) or a Gateway API one (`4s`, `500ms`, `1m30s`) in seconds."""
    parts = re.findall(r"([0-9.]+)(ms|h|m|s)", duration)
    assert parts and "".join(n + u for n, u in parts) == duration, duration
    unit = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
    return sum(float(n) * unit[u] for n, u in parts)


def cluster_problems(cluster: dict[str, Any]) -> list[str]:
    """What is wrong with a cluster to an engine: no idle timeout under the engine's keep-alive."""
    options = cluster.get("typed_extension_protocol_options", {}).get(HTTP_OPTIONS, {})
    idle = options.get("common_http_protocol_options", {}).get("idle_timeout")
    if idle is None:
        return [f"cluster {cluster['name']}: no idle_timeout (Envoy's default is 1 hour)"]
    if not 0 < seconds(idle) < ENGINE_KEEP_ALIVE_S:
        return [f"cluster {cluster['name']}: idle_timeout {idle} is not under the engine's keep-alive"]
    return []


def retry_problems(where: str, policy: dict[str, Any] | None) -> list[str]:
    """What is wrong with a route's retry policy (RetryPolicy, or Envoy Gateway's Retry): it must retry only
    resets before the request went out, once or twice, with no per-try timeout (the route has none)."""
    if policy is None:
        return [f"{where}: no retry policy"]
    if "retry_on" in policy:  # Envoy's RetryPolicy
        conditions = policy["retry_on"].split(",")
        retries = policy.get("num_retries", 1)  # "Envoy will default to retrying one time"
        per_try = policy.get("per_try_timeout")
    else:  # Envoy Gateway's Retry (api/v1alpha1/retry_types.go): numRetries defaults to 2
        conditions = policy.get("retryOn", {}).get("triggers", [])
        retries = policy.get("numRetries", 2)
        per_try = policy.get("perRetry", {}).get("timeout")
    problems = []
    if conditions != [RETRY_ON]:
        problems.append(f"{where}: retries on {conditions}, not only {RETRY_ON}")
    if not 1 <= retries <= MAX_RETRIES:
        problems.append(f"{where}: {retries} retries")
    if per_try is not None:
        problems.append(f"{where}: a per-try timeout ({per_try}) would cut a streaming generation")
    return problems


def bootstrap_problems(bootstrap: dict[str, Any], cds: list[dict[str, Any]] | None = None) -> list[str]:
    """Every route of every listener that forwards, and every cluster those routes name (static, or from
    the CDS file `cds`)."""
    clusters = {c["name"]: c for c in [*bootstrap["static_resources"].get("clusters", []), *(cds or [])]}
    problems: list[str] = []
    routed: set[str] = set()
    for hcm in http_connection_managers(bootstrap):
        for vhost in hcm["route_config"]["virtual_hosts"]:
            for route in vhost["routes"]:
                action = route.get("route")
                if action is None:
                    continue  # a direct response
                routed.add(action["cluster"])
                policy = action.get("retry_policy", vhost.get("retry_policy"))
                problems += retry_problems(f"route {route.get('name')!r}", policy)
    assert routed, "no route forwards anywhere"
    assert SIDECAR_CLUSTER not in routed
    for name in sorted(routed):
        problems += cluster_problems(clusters[name])
    return problems


@pytest.mark.parametrize("path", PLAIN_BOOTSTRAPS, ids=lambda p: str(p.relative_to(REPO)))
def test_plain_envoy_configs(path: Path) -> None:
    assert bootstrap_problems(yaml.safe_load(path.read_text())) == []


@pytest.mark.parametrize("upstream", [None, ("vllm.llm-serving.svc", 8000)], ids=["simulator", "own-engine"])
@pytest.mark.parametrize("profile", PROFILES)
def test_local_stack_configs(profile: str, upstream: tuple[str, int] | None) -> None:
    config = render_envoy_config(Ports.free(), profile=profile, upstream=upstream)
    assert bootstrap_problems(config) == []


def test_the_cds_engine_cluster_is_the_reference_one_for_any_engine() -> None:
    """`python -m extproc envoy-upstream URL` writes the Kubernetes gateway's engine: the same connection
    settings as envoy/envoy.yaml's, for a plain or a TLS engine."""
    template = yaml.safe_load(ENVOY_TEMPLATE.read_text())["static_resources"]["clusters"]
    reference = next(c for c in template if c["name"] == "llm_upstream")["typed_extension_protocol_options"]
    for url in ("http://vllm.llm-serving.svc:8000", "https://vllm.inference.svc:8443"):
        cluster = upstream_cluster(EngineAddress.parse(url))
        assert cluster_problems(cluster) == []
        assert cluster["typed_extension_protocol_options"] == reference


KUSTOMIZATIONS = roots("Kustomization")


@pytest.mark.parametrize("root", KUSTOMIZATIONS, ids=lambda p: str(p.relative_to(REPO)))
def test_kubernetes_builds(root: Path) -> None:
    """What `kubectl apply -k` sends: the gateway pod's Envoy with the engine cluster its CDS file holds, and
    Envoy Gateway's policy for each route of its Gateway."""
    docs = built(root)
    problems: list[str] = []
    if any(d["kind"] == "Deployment" and d["metadata"]["name"] == "extproc-gateway" for d in docs):
        files = envoy_files(docs)
        bootstraps = [yaml.safe_load(t) for t in files.values() if "static_resources:" in t]
        assert len(bootstraps) == 1, sorted(files)
        bootstrap = bootstraps[0]
        cds_path = bootstrap["dynamic_resources"]["cds_config"]["path_config_source"]["path"]
        problems += bootstrap_problems(bootstrap, clusters_of(yaml.safe_load(files[cds_path])))
    for gateway in (d for d in docs if d["kind"] == "Gateway" and d["spec"]["gatewayClassName"] == "eg"):
        problems += envoy_gateway_problems(docs, gateway["metadata"]["name"])
    for envoy_filter in (d for d in docs if d["kind"] == "EnvoyFilter"):
        problems += istio_problems(envoy_filter)
    assert problems == []


def targets(policy: dict[str, Any], kind: str, name: str) -> bool:
    return any(t["kind"] == kind and t["name"] == name for t in policy["spec"].get("targetRefs", []))


def merged(parent: dict[str, Any], child: dict[str, Any]) -> dict[str, Any]:
    """`child` merged into `parent` (a route policy's mergeType: its fields win, the parent's others stay)."""
    out = dict(parent)
    for key, value in child.items():
        both = isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = merged(out[key], value) if both else value
    return out


def envoy_gateway_problems(docs: tuple[dict[str, Any], ...], gateway: str) -> list[str]:
    """Each HTTPRoute of the Gateway under the BackendTrafficPolicy that applies to it: a route-level one,
    merged into the Gateway's where it sets mergeType (else it replaces it), or the Gateway's (Envoy Gateway
    v1.9.0 api/v1alpha1/backendtrafficpolicy_types.go MergeType)."""
    policies = [d for d in docs if d["kind"] == "BackendTrafficPolicy"]
    gateway_level = [p["spec"] for p in policies if targets(p, "Gateway", gateway)]
    assert len(gateway_level) <= 1
    routes = [
        d
        for d in docs
        if d["kind"] == "HTTPRoute" and any(ref["name"] == gateway for ref in d["spec"]["parentRefs"])
    ]
    problems: list[str] = []
    for route in routes:
        name = route["metadata"]["name"]
        spec = gateway_level[0] if gateway_level else {}
        for policy in (p["spec"] for p in policies if targets(p, "HTTPRoute", name)):
            spec = merged(spec, policy) if "mergeType" in policy else policy
        idle = spec.get("timeout", {}).get("http", {}).get("connectionIdleTimeout")
        if idle is None or not 0 < seconds(idle) < ENGINE_KEEP_ALIVE_S:
            problems.append(f"HTTPRoute {name}: connectionIdleTimeout {idle}, not under the keep-alive")
        problems += retry_problems(f"HTTPRoute {name}", spec.get("retry"))
    return problems


def istio_problems(envoy_filter: dict[str, Any]) -> list[str]:
    """An EnvoyFilter that added a route or an engine cluster would have to carry the settings too: the
    shipped ones add only the sidecar's cluster."""
    problems = []
    for patch in envoy_filter["spec"]["configPatches"]:
        value = patch["patch"].get("value", {})
        if patch["applyTo"] == "CLUSTER" and value.get("name") != SIDECAR_CLUSTER:
            problems.append(f"{envoy_filter['metadata']['name']}: adds cluster {value.get('name')}")
        if patch["applyTo"] in ("ROUTE_CONFIGURATION", "HTTP_ROUTE") or "routes" in yaml.safe_dump(value):
            problems.append(f"{envoy_filter['metadata']['name']}: adds routes ({patch['applyTo']})")
    return problems


@pytest.mark.parametrize("path", ISTIO_FILTERS, ids=lambda p: str(p.relative_to(REPO)))
def test_istio_filters_leave_the_engine_to_the_operator(path: Path) -> None:
    assert istio_problems(yaml.safe_load(path.read_text())) == []


ENVOY_CONFIG_MARKERS = (
    "static_resources:",
    "type.googleapis.com/envoy.config.cluster.v3.Cluster",
    "kind: EnvoyFilter",
    "kind: BackendTrafficPolicy",
)


def test_the_walk_reaches_every_shipped_envoy_config() -> None:
    """A file of Envoy config under envoy/ is walked by name above; one under k8s/ must sit in a build the
    walk makes (a Kustomization root or a folder below one)."""
    found = [
        path
        for folder in (REPO / "envoy", K8S)
        for path in sorted(folder.rglob("*.yaml"))
        if any(marker in path.read_text() for marker in ENVOY_CONFIG_MARKERS)
    ]
    assert ENVOY_TEMPLATE in found and K8S / "gateway" / "upstream.yaml" in found
    walked_files = {*PLAIN_BOOTSTRAPS, *ISTIO_FILTERS}
    for path in found:
        if path.is_relative_to(REPO / "envoy"):
            assert path in walked_files, path
        else:
            parents = PurePosixPath(path.relative_to(REPO)).parents
            assert any(REPO / parent in KUSTOMIZATIONS for parent in parents), path
