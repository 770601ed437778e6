"""The Kubernetes manifests are valid for the API server, as `kubectl apply -k` sends them.

The objects checked are the output of `kubectl kustomize` on every shipped kustomization
(tests/unit/k8s/kustomize_build.py), plus the Istio EnvoyFilter, which is applied on its own. Built-in objects
validate against the Kubernetes OpenAPI schemas for KUBERNETES_VERSION shipped in the `kubernetes-validate`
package (strict: unknown fields are errors). Custom resources (Envoy Gateway policies, Istio's EnvoyFilters
and DestinationRule, Prometheus Operator objects) validate against our own JSON Schemas in
tests/data/schemas/, one per group, version and kind: each states the part of the published CRD's
openAPIV3Schema that our manifests touch (every allowed field name at the levels we use, so a misspelt field
is refused as by `kubectl apply`; types, enums, patterns, required fields; the CEL rules of those levels as
JSON Schema conditions) and names the CRD release it was derived from.
"""

from __future__ import annotations

import copy
import functools
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from jsonschema.exceptions import ValidationError
from jsonschema.protocols import Validator

from extproc.config import load_config
from tests.unit.k8s.kustomize_build import K8S, REPO, built, built_objects

ISTIO_FILTER = REPO / "envoy" / "istio" / "envoyfilter.yaml"
KUBERNETES_VERSION = "1.33.0"
NOT_OBJECTS = {"config.yaml", "envoy.yaml", "kustomization.yaml", "upstream.yaml"}
SCHEMAS = REPO / "tests" / "data" / "schemas"
# Every custom resource we ship, as (apiVersion, kind); each has SCHEMAS/<group>_<version>_<kind>.yaml.
CUSTOM_RESOURCES = {
    ("gateway.envoyproxy.io/v1alpha1", "EnvoyExtensionPolicy"),
    ("gateway.envoyproxy.io/v1alpha1", "ClientTrafficPolicy"),
    ("gateway.envoyproxy.io/v1alpha1", "BackendTrafficPolicy"),
    ("gateway.envoyproxy.io/v1alpha1", "EnvoyProxy"),
    ("gateway.networking.k8s.io/v1", "Gateway"),
    ("gateway.networking.k8s.io/v1", "HTTPRoute"),
    ("inference.networking.k8s.io/v1", "InferencePool"),
    ("networking.istio.io/v1alpha3", "EnvoyFilter"),
    ("networking.istio.io/v1", "DestinationRule"),
    ("monitoring.coreos.com/v1", "ServiceMonitor"),
    ("monitoring.coreos.com/v1", "PrometheusRule"),
}
CUSTOM_GROUPS = {api_version.split("/")[0] for api_version, _ in CUSTOM_RESOURCES}


def objects() -> Iterator[tuple[str, dict[str, Any]]]:
    """Every Kubernetes object the project ships, with where it comes from: each kustomization's build, and
    the Istio EnvoyFilter."""
    yield from built_objects()
    for doc in yaml.safe_load_all(ISTIO_FILTER.read_text()):
        if doc:
            yield str(ISTIO_FILTER.relative_to(REPO)), doc


def is_custom(doc: dict[str, Any]) -> bool:
    return doc["apiVersion"].split("/")[0] in CUSTOM_GROUPS


def list_map_keys(
    validator: Validator, keys: list[str], instance: Any, schema: dict[str, Any]
) -> Iterator[ValidationError]:
    """`x-kubernetes-list-map-keys`: a list of type map, which the API server refuses to hold two entries with
    the same key values (JSON Schema's uniqueItems compares whole entries, so it cannot say this)."""
    if not validator.is_type(instance, "array"):
        return
    first: dict[str, int] = {}
    for index, item in enumerate(instance):
        if not isinstance(item, dict):
            continue
        key = json.dumps([item.get(name) for name in keys])
        if key in first:
            yield ValidationError(f"entries {first[key]} and {index} have the same {'/'.join(keys)} {key}")
        first.setdefault(key, index)


# types-jsonschema leaves validators.extend unannotated; what it returns is a validator class.
CustomResourceValidator: type[Validator] = jsonschema.validators.extend(  # type: ignore[no-untyped-call]
    jsonschema.Draft202012Validator, {"x-kubernetes-list-map-keys": list_map_keys}
)


def schema_path(api_version: str, kind: str) -> Path:
    group, version = api_version.split("/")
    return SCHEMAS / f"{group}_{version}_{kind}.yaml"


@functools.cache
def validator_for(api_version: str, kind: str) -> Validator:
    path = schema_path(api_version, kind)
    assert path.is_file(), (
        f"no schema {path.relative_to(REPO)} for {kind} {api_version}: write one from the published CRD "
        "(see the other files in tests/data/schemas/)"
    )
    schema = yaml.safe_load(path.read_text())
    CustomResourceValidator.check_schema(schema)
    return CustomResourceValidator(schema)


def schema_errors(doc: dict[str, Any]) -> list[ValidationError]:
    errors = validator_for(doc["apiVersion"], doc["kind"]).iter_errors(doc)
    return sorted(errors, key=lambda e: [str(p) for p in e.absolute_path])


@functools.cache
def parsed_objects() -> tuple[tuple[str, dict[str, Any]], ...]:
    return tuple(objects())


BROKEN_NAMES = {"EnvoyFilter": "extproc-admission"}
"""The object a kind's cases below break, where it ships more than one: the patches they index are its."""


def shipped(kind: str) -> dict[str, Any]:
    """A deep copy of the first shipped object of this kind (of BROKEN_NAMES' name, if any), to break."""
    name = BROKEN_NAMES.get(kind)
    return copy.deepcopy(
        next(
            doc
            for _, doc in parsed_objects()
            if doc["kind"] == kind and name in (None, doc["metadata"]["name"])
        )
    )


def test_builtin_objects_validate_against_the_kubernetes_schema() -> None:
    checked = set()
    for where, doc in objects():
        if is_custom(doc):
            continue
        try:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            raise AssertionError(f"{where} {doc['kind']}: {exc.message} at {exc.path}") from exc
        checked.add(doc["kind"])
    assert {"Deployment", "DaemonSet", "Service", "PriorityClass", "ClusterRole"} <= checked


def test_custom_resources_validate_against_their_crd_schema() -> None:
    checked = set()
    for where, doc in objects():
        if not is_custom(doc):
            continue
        errors = schema_errors(doc)
        assert not errors, f"{where} {doc['kind']}: " + "; ".join(
            f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in errors[:5]
        )
        checked.add((doc["apiVersion"], doc["kind"]))
    assert checked == CUSTOM_RESOURCES
    assert set(SCHEMAS.glob("*.yaml")) == {schema_path(*resource) for resource in CUSTOM_RESOURCES}


def test_a_custom_resource_without_a_schema_fails_loudly() -> None:
    doc = shipped("ServiceMonitor")
    doc["apiVersion"] = "monitoring.coreos.com/v1alpha1"
    with pytest.raises(
        AssertionError,
        match=r"no schema tests/data/schemas/monitoring\.coreos\.com_v1alpha1_ServiceMonitor\.yaml",
    ):
        schema_errors(doc)


def open_levels(node: Any, where: str) -> Iterator[str]:
    """Object levels that list properties without saying what happens to others (walks the structure only:
    properties, items, additionalProperties and $defs, not the conditions of if/not/anyOf)."""
    if not isinstance(node, dict):
        return
    if "properties" in node and "additionalProperties" not in node:
        yield where
    for name, sub in node.get("properties", {}).items():
        yield from open_levels(sub, f"{where}.{name}")
    for name, sub in node.get("$defs", {}).items():
        yield from open_levels(sub, f"$defs.{name}")
    yield from open_levels(node.get("items"), f"{where}[]")
    yield from open_levels(node.get("additionalProperties"), f"{where}.*")


@pytest.mark.parametrize("path", sorted(SCHEMAS.glob("*.yaml")), ids=lambda p: p.stem)
def test_each_schema_names_its_source_and_refuses_unknown_fields(path: Path) -> None:
    header = " ".join(line.lstrip("# ") for line in path.read_text().split("\n$schema:")[0].splitlines())
    assert "Derived from" in header and "release tag" in header and "commit" in header, path.name
    schema = yaml.safe_load(path.read_text())
    CustomResourceValidator.check_schema(schema)
    assert not list(open_levels(schema, "")), f"{path.name}: levels without additionalProperties"


def rename(obj: dict[str, Any], old: str, new: str) -> None:
    obj[new] = obj.pop(old)


Change = Callable[[dict[str, Any]], Any]


def extproc(doc: dict[str, Any]) -> Any:
    return doc["spec"]["extProc"][0]


def early_headers(doc: dict[str, Any]) -> Any:
    return doc["spec"]["headers"]["earlyRequestHeaders"]


def override(doc: dict[str, Any]) -> Any:
    return doc["spec"]["responseOverride"][0]


def patch(doc: dict[str, Any], index: int = 0) -> Any:
    return doc["spec"]["configPatches"][index]


def als_sink(doc: dict[str, Any]) -> Any:
    return doc["spec"]["telemetry"]["accessLog"]["settings"][0]["sinks"][0]


def rule(doc: dict[str, Any]) -> Any:
    return doc["spec"]["groups"][0]["rules"][0]


EXT_PROC = ("spec", "extProc", 0)
RESPONSE_OVERRIDE = ("spec", "responseOverride", 0)
# (kind, change, where the error must be, the JSON Schema keyword that must refuse it)
BROKEN: list[Any] = [
    # EnvoyExtensionPolicy
    pytest.param(
        "EnvoyExtensionPolicy",
        lambda d: rename(extproc(d), "messageTimeout", "messageTimeOut"),
        EXT_PROC,
        "additionalProperties",
        id="eep-misspelt-messageTimeout",
    ),
    pytest.param(
        "EnvoyExtensionPolicy",
        lambda d: extproc(d)["processingMode"]["request"].update(body="Buffering"),
        (*EXT_PROC, "processingMode", "request", "body"),
        "enum",
        id="eep-bad-body-mode",
    ),
    pytest.param(
        "EnvoyExtensionPolicy",
        lambda d: d["spec"]["targetRefs"][0].pop("name"),
        ("spec", "targetRefs", 0),
        "required",
        id="eep-target-without-name",
    ),
    pytest.param(
        "EnvoyExtensionPolicy",
        lambda d: extproc(d)["processingMode"]["request"].update(attributes=["client.address"]),
        (*EXT_PROC, "processingMode", "request", "attributes", 0),
        "pattern",
        id="eep-bad-attribute",
    ),
    pytest.param(
        "EnvoyExtensionPolicy",
        lambda d: extproc(d).update(messageTimeout="1 second"),
        (*EXT_PROC, "messageTimeout"),
        "pattern",
        id="eep-bad-duration",
    ),
    pytest.param(
        "EnvoyExtensionPolicy",
        lambda d: extproc(d)["backendRefs"][0].pop("port"),
        (*EXT_PROC, "backendRefs", 0),
        "required",
        id="eep-cel-service-without-port",
    ),
    pytest.param(
        "EnvoyExtensionPolicy",
        lambda d: d["spec"]["targetRefs"][0].update(group="gateway.envoyproxy.io"),
        ("spec", "targetRefs", 0, "group"),
        "const",
        id="eep-cel-target-group",
    ),
    pytest.param(
        "EnvoyExtensionPolicy",
        lambda d: extproc(d).update(
            failOpen=True, processingMode={"request": {"body": "FullDuplexStreamed"}}
        ),
        (*EXT_PROC, "processingMode", "request", "body"),
        "not",
        id="eep-cel-full-duplex-fail-open",
    ),
    pytest.param(
        "EnvoyExtensionPolicy",
        lambda d: extproc(d).update(backendRef={"name": "extproc-admission", "port": 50051}),
        EXT_PROC,
        "not",
        id="eep-cel-singular-backendRef",
    ),
    # ClientTrafficPolicy
    pytest.param(
        "ClientTrafficPolicy",
        lambda d: rename(d["spec"]["headers"], "withUnderscoresAction", "withUnderscoreAction"),
        ("spec", "headers"),
        "additionalProperties",
        id="ctp-misspelt-withUnderscoresAction",
    ),
    pytest.param(
        "ClientTrafficPolicy",
        lambda d: d["spec"]["headers"].update(withUnderscoresAction="Drop"),
        ("spec", "headers", "withUnderscoresAction"),
        "enum",
        id="ctp-bad-underscores-action",
    ),
    pytest.param(
        "ClientTrafficPolicy",
        lambda d: early_headers(d)["removeOnMatch"][0].pop("value"),
        ("spec", "headers", "earlyRequestHeaders", "removeOnMatch", 0),
        "required",
        id="ctp-match-without-value",
    ),
    pytest.param(
        "ClientTrafficPolicy",
        lambda d: d["spec"]["connection"].update(bufferLimit="2MB"),
        ("spec", "connection", "bufferLimit"),
        "pattern",
        id="ctp-bad-quantity",
    ),
    pytest.param(
        "ClientTrafficPolicy",
        lambda d: early_headers(d)["remove"].append(early_headers(d)["remove"][0]),
        ("spec", "headers", "earlyRequestHeaders", "remove"),
        "uniqueItems",
        id="ctp-set-with-duplicates",
    ),
    pytest.param(
        "ClientTrafficPolicy",
        lambda d: d["spec"]["targetRefs"][0].update(kind="HTTPRoute"),
        ("spec", "targetRefs", 0, "kind"),
        "enum",
        id="ctp-cel-target-kind",
    ),
    pytest.param(
        "ClientTrafficPolicy",
        lambda d: d["spec"].pop("targetRefs"),
        ("spec",),
        "anyOf",
        id="ctp-cel-no-target",
    ),
    # BackendTrafficPolicy
    pytest.param(
        "BackendTrafficPolicy",
        lambda d: rename(override(d)["response"], "contentType", "content_type"),
        (*RESPONSE_OVERRIDE, "response"),
        "additionalProperties",
        id="btp-misspelt-contentType",
    ),
    pytest.param(
        "BackendTrafficPolicy",
        lambda d: override(d).update(source="local"),
        (*RESPONSE_OVERRIDE, "source"),
        "enum",
        id="btp-bad-source",
    ),
    pytest.param(
        "BackendTrafficPolicy",
        lambda d: override(d).pop("match"),
        RESPONSE_OVERRIDE,
        "required",
        id="btp-override-without-match",
    ),
    pytest.param(
        "BackendTrafficPolicy",
        lambda d: override(d)["response"]["body"].pop("inline"),
        (*RESPONSE_OVERRIDE, "response", "body"),
        "required",
        id="btp-cel-inline-body-without-inline",
    ),
    pytest.param(
        "BackendTrafficPolicy",
        lambda d: override(d)["match"]["statusCodes"][0].pop("value"),
        (*RESPONSE_OVERRIDE, "match", "statusCodes", 0),
        "required",
        id="btp-cel-value-match-without-value",
    ),
    pytest.param(
        "BackendTrafficPolicy",
        lambda d: override(d).update(redirect={"statusCode": 302}),
        RESPONSE_OVERRIDE,
        "oneOf",
        id="btp-cel-response-and-redirect",
    ),
    pytest.param(
        "BackendTrafficPolicy",
        lambda d: d["spec"]["retry"]["retryOn"].update(triggers=["reset_before_request"]),
        ("spec", "retry", "retryOn", "triggers", 0),
        "enum",
        id="btp-misspelt-retry-trigger",
    ),
    pytest.param(
        "BackendTrafficPolicy",
        lambda d: d["spec"]["timeout"]["http"].update(connectionIdleTimeout="4 s"),
        ("spec", "timeout", "http", "connectionIdleTimeout"),
        "pattern",
        id="btp-bad-idle-timeout",
    ),
    # EnvoyExtensionPolicy, lean: the Lua reader and the metadata namespaces
    pytest.param(
        "EnvoyExtensionPolicy",
        lambda d: d["spec"].update(lua=[{"type": "ValueRef", "inline": "return"}]),
        ("spec", "lua", 0),
        "oneOf",
        id="eep-cel-lua-valueRef-without-valueRef",
    ),
    pytest.param(
        "EnvoyExtensionPolicy",
        lambda d: extproc(d).update(metadata={"writableNamespaces": ["envoy.filters.http.lua"]}),
        (*EXT_PROC, "metadata", "writableNamespaces", 0),
        "not",
        id="eep-cel-writable-envoy-namespace",
    ),
    # EnvoyProxy
    pytest.param(
        "EnvoyProxy",
        lambda d: rename(als_sink(d)["als"], "logName", "log_name"),
        ("spec", "telemetry", "accessLog", "settings", 0, "sinks", 0, "als"),
        "additionalProperties",
        id="ep-misspelt-logName",
    ),
    pytest.param(
        "EnvoyProxy",
        lambda d: als_sink(d).update(type="GRPC"),
        ("spec", "telemetry", "accessLog", "settings", 0, "sinks", 0, "type"),
        "enum",
        id="ep-bad-sink-type",
    ),
    pytest.param(
        "EnvoyProxy",
        lambda d: als_sink(d)["als"].pop("type"),
        ("spec", "telemetry", "accessLog", "settings", 0, "sinks", 0, "als"),
        "required",
        id="ep-als-without-type",
    ),
    # Gateway, HTTPRoute
    pytest.param(
        "Gateway",
        lambda d: d["spec"]["listeners"][0].update(protocol="http", port=0),
        ("spec", "listeners", 0, "port"),
        "minimum",
        id="gw-bad-port",
    ),
    pytest.param(
        "HTTPRoute",
        lambda d: d["spec"]["rules"][0]["matches"][0]["path"].update(type="Prefix"),
        ("spec", "rules", 0, "matches", 0, "path", "type"),
        "enum",
        id="route-bad-path-type",
    ),
    # EnvoyFilter (the CRD requires no field at the levels we use)
    pytest.param(
        "EnvoyFilter",
        lambda d: rename(patch(d)["patch"], "operation", "opration"),
        ("spec", "configPatches", 0, "patch"),
        "additionalProperties",
        id="ef-misspelt-operation",
    ),
    pytest.param(
        "EnvoyFilter",
        lambda d: patch(d).update(applyTo="HTTP_FILTERS"),
        ("spec", "configPatches", 0, "applyTo"),
        "enum",
        id="ef-bad-applyTo",
    ),
    pytest.param(
        "EnvoyFilter",
        lambda d: rename(patch(d, 2)["match"]["listener"]["filterChain"], "filter", "filters"),
        ("spec", "configPatches", 2, "match", "listener", "filterChain"),
        "additionalProperties",
        id="ef-misspelt-filter-match",
    ),
    pytest.param(
        "EnvoyFilter",
        lambda d: d["spec"].update(targetRefs=[{"kind": "Gateway", "name": "llm-gateway"}]),
        ("spec",),
        "not",
        id="ef-cel-selector-and-targetRefs",
    ),
    pytest.param(
        "EnvoyFilter",
        lambda d: d["spec"]["workloadSelector"]["labels"].update(istio="ingress*"),
        ("spec", "workloadSelector", "labels", "istio"),
        "pattern",
        id="ef-cel-wildcard-selector",
    ),
    pytest.param(
        "EnvoyFilter",
        lambda d: patch(d, 2)["match"].update(cluster={"name": "outbound"}),
        ("spec", "configPatches", 2, "match"),
        "not",
        id="ef-two-match-kinds",
    ),
    pytest.param(
        "EnvoyFilter",
        lambda d: patch(d)["match"].update(routeConfiguration={"vhost": {"route": {"nam": "x"}}}),
        ("spec", "configPatches", 0, "match", "routeConfiguration", "vhost", "route"),
        "additionalProperties",
        id="ef-misspelt-route-name-match",
    ),
    # DestinationRule
    pytest.param(
        "DestinationRule",
        lambda d: rename(d["spec"]["trafficPolicy"]["connectionPool"]["http"], "idleTimeout", "idleTimout"),
        ("spec", "trafficPolicy", "connectionPool", "http"),
        "additionalProperties",
        id="dr-misspelt-idleTimeout",
    ),
    pytest.param(
        "DestinationRule",
        lambda d: d["spec"].pop("host"),
        ("spec",),
        "required",
        id="dr-without-host",
    ),
    # ServiceMonitor
    pytest.param(
        "ServiceMonitor",
        lambda d: rename(d["spec"]["endpoints"][0], "interval", "intervall"),
        ("spec", "endpoints", 0),
        "additionalProperties",
        id="sm-misspelt-interval",
    ),
    pytest.param(
        "ServiceMonitor",
        lambda d: d["spec"]["endpoints"][0].update(scheme="tcp"),
        ("spec", "endpoints", 0, "scheme"),
        "enum",
        id="sm-bad-scheme",
    ),
    pytest.param(
        "ServiceMonitor",
        lambda d: d["spec"].pop("selector"),
        ("spec",),
        "required",
        id="sm-without-selector",
    ),
    pytest.param(
        "ServiceMonitor",
        lambda d: d["spec"]["endpoints"][0].update(interval="15 s"),
        ("spec", "endpoints", 0, "interval"),
        "pattern",
        id="sm-bad-interval",
    ),
    # PrometheusRule (the CRD has no enum)
    pytest.param(
        "PrometheusRule",
        lambda d: rename(rule(d), "annotations", "annotation"),
        ("spec", "groups", 0, "rules", 0),
        "additionalProperties",
        id="pr-misspelt-annotations",
    ),
    pytest.param(
        "PrometheusRule",
        lambda d: rule(d).pop("expr"),
        ("spec", "groups", 0, "rules", 0),
        "required",
        id="pr-rule-without-expr",
    ),
    pytest.param(
        "PrometheusRule",
        lambda d: rule(d).update({"for": "2 minutes"}),
        ("spec", "groups", 0, "rules", 0, "for"),
        "pattern",
        id="pr-bad-for",
    ),
    pytest.param(
        "PrometheusRule",
        lambda d: d["spec"]["groups"].append(copy.deepcopy(d["spec"]["groups"][0])),
        ("spec", "groups"),
        "x-kubernetes-list-map-keys",
        id="pr-two-groups-of-one-name",
    ),
]


@pytest.mark.parametrize(("kind", "change", "where", "keyword"), BROKEN)
def test_a_broken_custom_resource_is_refused(
    kind: str, change: Change, where: tuple[str | int, ...], keyword: str
) -> None:
    """Each schema refuses what the API server would: a misspelt field, a wrong enum value, a missing
    required field, a bad pattern, a broken CEL rule. The error must be the one the change made, at its
    place, so a case cannot pass on an unrelated error."""
    doc = shipped(kind)
    assert not schema_errors(doc)
    change(doc)
    errors = schema_errors(doc)
    found = [(tuple(e.absolute_path), e.validator) for e in errors]
    assert (where, keyword) in found, f"expected {keyword} at {where}, got {found}"


def test_exporter_does_not_ask_for_a_system_priority_class() -> None:
    """system-node-critical outside kube-system is refused on clusters that limit the critical classes."""
    docs = built(K8S / "exporter")
    daemonset = next(d for d in docs if d["kind"] == "DaemonSet")
    name = daemonset["spec"]["template"]["spec"]["priorityClassName"]
    assert not name.startswith("system-")
    priority_class = next(d for d in docs if d["kind"] == "PriorityClass" and d["metadata"]["name"] == name)
    assert priority_class["preemptionPolicy"] == "Never" and not priority_class["globalDefault"]
    kustomization = yaml.safe_load((K8S / "exporter" / "kustomization.yaml").read_text())
    assert "priorityclass.yaml" in kustomization["resources"]


ENVOY_GATEWAY_PROFILES = [K8S / "envoy-gateway" / "inline", K8S / "envoy-gateway" / "lean"]


@pytest.mark.parametrize(
    "config", [K8S / "gateway" / "config.yaml", *(p / "config.yaml" for p in ENVOY_GATEWAY_PROFILES)]
)
def test_sidecar_configs_are_valid(config: Path) -> None:
    load_config(config)


@pytest.mark.parametrize("profile", ENVOY_GATEWAY_PROFILES, ids=lambda p: p.name)
def test_envoy_gateway_sidecar_config_refuses_queueing_classes(profile: Path) -> None:
    """Envoy Gateway sets no max_message_timeout, so the sidecar cannot extend Envoy's timer to wait."""
    config = yaml.safe_load((profile / "config.yaml").read_text())
    policy = next(doc for doc in built(profile) if doc["kind"] == "EnvoyExtensionPolicy")
    timeout = policy["spec"]["extProc"][0]["messageTimeout"]
    assert config["admission"]["envoy_max_message_timeout_seconds"] == float(timeout.removesuffix("s"))


def test_every_manifest_parses_and_has_kind() -> None:
    files = sorted(K8S.rglob("*.yaml"))
    assert files
    for path in files:
        if path.name in NOT_OBJECTS:
            continue
        for doc in yaml.safe_load_all(path.read_text()):
            assert doc and "kind" in doc and "apiVersion" in doc, path


def test_gateway_sidecar_config_is_valid_and_matches_the_pod() -> None:
    config = load_config(K8S / "gateway" / "config.yaml")
    deployment = yaml.safe_load((K8S / "gateway" / "deployment.yaml").read_text())
    pod = deployment["spec"]["template"]["spec"]
    sidecar = next(c for c in pod["containers"] if c["name"] == "extproc")
    ports = {p["containerPort"] for p in sidecar["ports"]}
    assert int(config.server.grpc_listen.rsplit(":", 1)[1]) in ports
    assert int(config.server.admin_listen.rsplit(":", 1)[1]) in ports
    # The sidecar must finish draining before the kubelet kills the pod.
    assert config.server.shutdown_grace_seconds < pod["terminationGracePeriodSeconds"]


def test_every_container_image_is_pinned() -> None:
    for where, doc in objects():
        spec = doc.get("spec", {}).get("template", {}).get("spec", {})
        for container in spec.get("containers", []):
            assert ":" in container["image"] and not container["image"].endswith(":latest"), where
