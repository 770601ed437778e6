"""Every shipped Envoy config closes an idle engine connection before the engine does, and retries a request
only while none of it has reached the engine (envoy/envoy.yaml's header: Engine keep-alive, Retries).

The walk: the plain-Envoy bootstraps (envoy/, their lean renderings, the local stack's renderings), every
Kubernetes build's gateway pod (its bootstrap, and the engine cluster of the CDS file it mounts), Envoy
Gateway's BackendTrafficPolicies as they apply to each HTTPRoute of its Gateway, each HTTPRoute to an
InferencePool on Istio as istiod turns it into a route and a cluster (its retry policy with the EnvoyFilter
patches that reach it, the DestinationRule of the pool's shadow Service), and the Istio EnvoyFilters (which
add no engine route or cluster: under envoy/istio/ those are the operator's, docs/gateways.md). A shipped
file of Envoy config that the walk does not reach fails the last test. That Envoy runs these settings as
meant (the idle close, a retry of a failed connect, none of a request the engine read) is
tests/e2e/test_engine_connections_e2e.py.
"""

from __future__ import annotations

import hashlib
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
POOL_GROUP = "inference.networking.k8s.io"
GATEWAY_LABEL = "gateway.networking.k8s.io/gateway-name"
ISTIO_ROOT_NAMESPACE = "istio-system"
"""Where an EnvoyFilter applies to the workloads of every namespace (istiod's default root namespace)."""
ISTIO_DEFAULT_RETRY = {
    "retry_on": "connect-failure,refused-stream,unavailable,cancelled,retriable-status-codes",
    "num_retries": 2,
}
"""The retry policy istiod gives a route whose rule sets none (istio/istio 1.30.3, commit 56df41f6,
pilot/pkg/networking/core/route/retry/retry.go: defaultRetryOn, defaultNumRetries)."""
GATEWAY_API_RETRY_ON = "connect-failure,refused-stream,unavailable,cancelled"
"""What istiod retries on for a rule's Gateway API `retry`, before its status codes (istio/istio 1.30.3,
pilot/pkg/config/kube/gateway/conversion.go, convertHTTPRoute): HTTPRouteRetry can name nothing else."""


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
    envoy_gateways = {d["metadata"]["name"] for d in docs if d["kind"] == "Gateway" and eg_gateway(d)}
    for gateway in sorted(envoy_gateways):
        problems += envoy_gateway_problems(docs, gateway)
    route_names: set[str] = set()
    for route in (d for d in docs if d["kind"] == "HTTPRoute"):
        if not {ref["name"] for ref in route["spec"]["parentRefs"]} & envoy_gateways:
            problems += istio_pool_route_problems(docs, route)
            route_names |= {istio_route_retry(route, i)[0] for i in range(len(route["spec"]["rules"]))}
    for envoy_filter in (d for d in docs if d["kind"] == "EnvoyFilter"):
        problems += istio_problems(envoy_filter)
        for patch in filter(retry_patch, envoy_filter["spec"]["configPatches"]):
            if not any(reaches(patch, name) for name in route_names):
                problems.append(
                    f"{envoy_filter['metadata']['name']}: a retry patch for no route of the build"
                )
    assert problems == []


def eg_gateway(gateway: dict[str, Any]) -> bool:
    return bool(gateway["spec"]["gatewayClassName"] == "eg")


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


def namespace(doc: dict[str, Any]) -> str:
    return str(doc["metadata"].get("namespace", "default"))


def shadow_service(pool: str) -> str:
    """The headless Service istiod creates for an InferencePool and routes its HTTPRoutes through: the pool's
    name, `-ip-` and the first 8 hex digits of the name's SHA-256, the name cut so that the whole fits 63
    characters (istio/istio 1.30.3, commit 56df41f6,
    pilot/pkg/config/kube/gateway/inferencepool_collection.go, InferencePoolServiceName and generateHash).
    istiod builds the gateway's cluster for it with the DestinationRule of that host
    (pilot/pkg/networking/core/cluster.go)."""
    digest = hashlib.sha256(pool.encode()).hexdigest()[:8]
    return f"{pool[: 63 - len('-ip-') - len(digest)]}-ip-{digest}"


def rule_host(rule: dict[str, Any]) -> tuple[str, str]:
    """The (service, namespace) a DestinationRule's host names: a short name is read in the rule's namespace
    (istio/api 1.30.3, commit 2e43f07b, networking/v1alpha3/destination_rule.proto, DestinationRule.host)."""
    host = str(rule["spec"]["host"])
    parts = host.split(".")
    if len(parts) == 1:
        return host, namespace(rule)
    assert len(parts) >= 4 and parts[2] == "svc", f"DestinationRule host {host}: not a Service's name"
    return parts[0], parts[1]


def istio_cluster_problems(docs: tuple[dict[str, Any], ...], pool: str, pool_namespace: str) -> list[str]:
    """The idle timeout of the gateway's cluster for the pool: its DestinationRule's
    connectionPool.http.idleTimeout, which istiod writes to common_http_protocol_options.idle_timeout
    (pilot/pkg/networking/core/cluster_traffic_policy.go); without one, Envoy's 1 hour."""
    service = shadow_service(pool)
    rules = [d for d in docs if d["kind"] == "DestinationRule" and rule_host(d) == (service, pool_namespace)]
    where = f"InferencePool {pool}'s cluster ({service})"
    if len(rules) != 1:
        return [f"{where}: {len(rules)} DestinationRules, not one with its idle timeout"]
    policy = rules[0]["spec"].get("trafficPolicy", {})
    if "portLevelSettings" in policy:
        return [f"{where}: portLevelSettings, which this walk does not read"]
    idle = policy.get("connectionPool", {}).get("http", {}).get("idleTimeout")
    if idle is None or not 0 < seconds(idle) < ENGINE_KEEP_ALIVE_S:
        return [f"{where}: idleTimeout {idle}, not under the keep-alive"]
    return []


def istio_route_retry(route: dict[str, Any], index: int) -> tuple[str, dict[str, Any]]:
    """The Envoy route istiod builds for one rule of a Gateway API HTTPRoute: its name, the rule's `name`
    or `NAMESPACE.ROUTE.INDEX` (conversion.go convertHTTPRoute; pilot/pkg/networking/core/route/route.go
    TranslateRoute), and its retry policy, the rule's `retry` (statuses become retriable-status-codes,
    retry.go ConvertPolicy; a backendRequest timeout the per-try timeout) or istiod's default."""
    rule = route["spec"]["rules"][index]
    name = rule.get("name") or f"{namespace(route)}.{route['metadata']['name']}.{index}"
    retry = rule.get("retry")
    if retry is None:
        return name, dict(ISTIO_DEFAULT_RETRY)
    codes = retry.get("codes", [])
    policy: dict[str, Any] = {
        "retry_on": GATEWAY_API_RETRY_ON + (",retriable-status-codes" if codes else ""),
        "num_retries": retry.get("attempts", 2),
    }
    backend_request = rule.get("timeouts", {}).get("backendRequest")
    if backend_request is not None and seconds(backend_request) > 0:
        policy["per_try_timeout"] = backend_request
    return name, policy


def selects(envoy_filter: dict[str, Any], gateway: str, gateway_namespace: str) -> bool:
    """Whether istiod applies the EnvoyFilter to the pods it runs for a Gateway API Gateway (labelled with
    the gateway's name): one in the root namespace or the gateway's, selecting them by label or naming the
    Gateway (istio/api 1.30.3, networking/v1alpha3/envoy_filter.proto, workloadSelector and targetRefs)."""
    if namespace(envoy_filter) not in (ISTIO_ROOT_NAMESPACE, gateway_namespace):
        return False
    spec = envoy_filter["spec"]
    if "targetRefs" in spec:
        return namespace(envoy_filter) == gateway_namespace and targets(envoy_filter, "Gateway", gateway)
    labels = spec.get("workloadSelector", {}).get("labels", {})
    return bool(labels.items() <= {GATEWAY_LABEL: gateway}.items())


def retry_patch(patch: dict[str, Any]) -> bool:
    """An HTTP_ROUTE MERGE that sets only the route's retry policy on a gateway route (checked with the
    HTTPRoute rule it reaches, istio_pool_route_problems)."""
    return (
        patch["applyTo"] == "HTTP_ROUTE"
        and patch["patch"]["operation"] == "MERGE"
        and patch.get("match", {}).get("context") == "GATEWAY"
        and list(patch["patch"]["value"]) == ["route"]
        and list(patch["patch"]["value"]["route"]) == ["retry_policy"]
    )


def reaches(patch: dict[str, Any], route_name: str) -> bool:
    """Whether a retry patch's match names this route (the match's other fields are unset, as checked)."""
    route_match = patch["match"].get("routeConfiguration", {}).get("vhost", {}).get("route", {})
    return bool(route_match.get("name") == route_name)


def istio_pool_route_problems(docs: tuple[dict[str, Any], ...], route: dict[str, Any]) -> list[str]:
    """Each rule of an HTTPRoute to an InferencePool, as istiod builds it on the gateways it names: the
    retry policy, with the MERGEs of the EnvoyFilters that reach it (MERGE replaces the fields it sets), and
    the idle timeout of the pool's cluster."""
    problems = []
    gateways = [(ref["name"], ref.get("namespace", namespace(route))) for ref in route["spec"]["parentRefs"]]
    for index, rule in enumerate(route["spec"]["rules"]):
        pools = [ref for ref in rule.get("backendRefs", []) if ref.get("group") == POOL_GROUP]
        if not pools:
            continue
        assert all(ref["kind"] == "InferencePool" for ref in pools), pools
        name, istio_policy = istio_route_retry(route, index)
        for gateway, gateway_namespace in gateways:
            policy = istio_policy
            for envoy_filter in (d for d in docs if d["kind"] == "EnvoyFilter"):
                if not selects(envoy_filter, gateway, gateway_namespace):
                    continue
                for patch in envoy_filter["spec"]["configPatches"]:
                    if retry_patch(patch) and reaches(patch, name):
                        policy = merged(policy, patch["patch"]["value"]["route"]["retry_policy"])
            problems += retry_problems(
                f"HTTPRoute {route['metadata']['name']} rule {name} on {gateway}", policy
            )
        for ref in pools:
            problems += istio_cluster_problems(docs, ref["name"], ref.get("namespace", namespace(route)))
    return problems


def istio_problems(envoy_filter: dict[str, Any]) -> list[str]:
    """An EnvoyFilter that added a route or an engine cluster would have to carry the settings too: the
    shipped ones add only the sidecar's cluster, and set the retry policy of a route istiod builds for an
    HTTPRoute to an InferencePool (retry_patch), each matched by its route's name alone."""
    problems = []
    for patch in envoy_filter["spec"]["configPatches"]:
        value = patch["patch"].get("value", {})
        if patch["applyTo"] == "CLUSTER" and value.get("name") != SIDECAR_CLUSTER:
            problems.append(f"{envoy_filter['metadata']['name']}: adds cluster {value.get('name')}")
        if retry_patch(patch):
            match = patch["match"].get("routeConfiguration", {})
            if match != {"vhost": {"route": {"name": match.get("vhost", {}).get("route", {}).get("name")}}}:
                problems.append(
                    f"{envoy_filter['metadata']['name']}: a retry patch not matched by name alone"
                )
            continue
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
