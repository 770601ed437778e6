"""The Kubernetes manifests hang together and are valid for the API server.

Every file parses and every kustomize reference exists. Built-in objects validate against the Kubernetes
OpenAPI schemas for KUBERNETES_VERSION shipped in the `kubernetes-validate` package (strict: unknown fields
are errors). Custom resources (Envoy Gateway policies, the Istio EnvoyFilter, Prometheus Operator objects)
validate against the openAPIV3Schema of their published CRDs, read from CRD_DIRS (see there): the schema
part only; CEL `x-kubernetes-validations` rules are not evaluated.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from extproc.config import load_config

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "k8s"
ISTIO_FILTER = REPO / "envoy" / "istio" / "envoyfilter.yaml"
KUBERNETES_VERSION = "1.33.0"
NOT_OBJECTS = {"config.yaml", "envoy.yaml", "kustomization.yaml"}
# The published CRDs: envoyproxy/gateway v1.9.0 charts/gateway-helm/charts/crds/crds/generated/, istio/istio
# 1.30.3 manifests/charts/base/files/crd-all.gen.yaml (EnvoyFilter), prometheus-operator v0.93.0
# example/prometheus-operator-crd/. They are fetched third-party data, so they live in the steering
# repository's shared/crds/ (beside this checkout), or in tests/data/crds/ where a project vendors them.
CRD_DIRS = (REPO / "tests" / "data" / "crds", REPO.parent / "shared" / "crds")
CRD_FILES = {
    ("gateway.envoyproxy.io", "EnvoyExtensionPolicy"): "gateway.envoyproxy.io_envoyextensionpolicies.yaml",
    ("gateway.envoyproxy.io", "ClientTrafficPolicy"): "gateway.envoyproxy.io_clienttrafficpolicies.yaml",
    ("gateway.envoyproxy.io", "BackendTrafficPolicy"): "gateway.envoyproxy.io_backendtrafficpolicies.yaml",
    ("networking.istio.io", "EnvoyFilter"): "networking.istio.io_envoyfilters.yaml",
    ("monitoring.coreos.com", "ServiceMonitor"): "monitoring.coreos.com_servicemonitors.yaml",
    ("monitoring.coreos.com", "PrometheusRule"): "monitoring.coreos.com_prometheusrules.yaml",
}


def objects() -> Iterator[tuple[Path, dict[str, Any]]]:
    """Every Kubernetes object the project ships (k8s/ and the Istio EnvoyFilter)."""
    for path in [*sorted(K8S.rglob("*.yaml")), ISTIO_FILTER]:
        if path.name in NOT_OBJECTS:
            continue
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                yield path, doc


def is_custom(doc: dict[str, Any]) -> bool:
    return doc["apiVersion"].split("/")[0] in {group for group, _ in CRD_FILES}


def crd_schema(group: str, kind: str, version: str) -> dict[str, Any]:
    name = CRD_FILES[(group, kind)]
    found = [d / name for d in CRD_DIRS if (d / name).is_file()]
    assert found, f"CRD {name} not found in {', '.join(map(str, CRD_DIRS))}: the schema test needs it"
    crd = next(d for d in yaml.safe_load_all(found[0].read_text()) if d)
    assert (crd["spec"]["group"], crd["spec"]["names"]["kind"]) == (group, kind)
    served = {v["name"]: v for v in crd["spec"]["versions"] if v.get("served", True)}
    assert version in served, f"{kind} {version} is not served by the CRD (served: {sorted(served)})"
    schema: dict[str, Any] = served[version]["schema"]["openAPIV3Schema"]
    # Every object has these at its root, whether or not a CRD lists them (Istio's do not).
    root = {"apiVersion": {"type": "string"}, "kind": {"type": "string"}, "metadata": {"type": "object"}}
    return closed({**schema, "properties": {**root, **schema["properties"]}})


def closed(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema with unknown fields refused, as `kubectl apply` does (strict field validation, the default
    since Kubernetes 1.27): every object that lists its properties and does not keep unknown fields gets
    additionalProperties false; metadata is left to the API server."""
    out = dict(schema)
    props = out.get("properties")
    if isinstance(props, dict):
        out["properties"] = {k: v if k == "metadata" else closed(v) for k, v in props.items()}
        if "additionalProperties" not in out and not out.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
    for key in ("items", "additionalProperties"):
        if isinstance(out.get(key), dict):
            out[key] = closed(out[key])
    for key in ("allOf", "anyOf", "oneOf"):
        if isinstance(out.get(key), list):
            out[key] = [closed(s) for s in out[key]]
    return out


def test_builtin_objects_validate_against_the_kubernetes_schema() -> None:
    checked = set()
    for path, doc in objects():
        if is_custom(doc):
            continue
        try:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            raise AssertionError(
                f"{path.relative_to(REPO)} {doc['kind']}: {exc.message} at {exc.path}"
            ) from exc
        checked.add(doc["kind"])
    assert {"Deployment", "DaemonSet", "Service", "PriorityClass", "ClusterRole"} <= checked


def test_custom_resources_validate_against_their_crd_schema() -> None:
    checked = set()
    for path, doc in objects():
        if not is_custom(doc):
            continue
        group, version = doc["apiVersion"].split("/")
        schema = crd_schema(group, doc["kind"], version)
        errors = sorted(jsonschema.Draft7Validator(schema).iter_errors(doc), key=lambda e: list(e.path))
        assert not errors, f"{path.relative_to(REPO)} {doc['kind']}: " + "; ".join(
            f"{'/'.join(map(str, e.path))}: {e.message}" for e in errors[:5]
        )
        checked.add(doc["kind"])
    assert checked == {kind for _, kind in CRD_FILES}


def test_crd_schema_check_catches_a_misspelt_field() -> None:
    """The CRD schemas are strict enough to fail: an unknown field or a bad enum value is an error."""
    policy = next(doc for _, doc in objects() if doc["kind"] == "EnvoyExtensionPolicy")
    schema = crd_schema("gateway.envoyproxy.io", "EnvoyExtensionPolicy", "v1alpha1")
    bad = yaml.safe_load(yaml.safe_dump(policy))
    bad["spec"]["extProc"][0]["processingMode"]["request"]["body"] = "Buffering"
    assert list(jsonschema.Draft7Validator(schema).iter_errors(bad))
    misspelt = yaml.safe_load(yaml.safe_dump(policy))
    misspelt["spec"]["extProc"][0]["messageTimeOut"] = misspelt["spec"]["extProc"][0].pop("messageTimeout")
    assert list(jsonschema.Draft7Validator(schema).iter_errors(misspelt))


def test_exporter_does_not_ask_for_a_system_priority_class() -> None:
    """system-node-critical outside kube-system is refused on clusters that limit the critical classes."""
    docs = [doc for path, doc in objects() if path.parent.name == "exporter"]
    daemonset = next(d for d in docs if d["kind"] == "DaemonSet")
    name = daemonset["spec"]["template"]["spec"]["priorityClassName"]
    assert not name.startswith("system-")
    priority_class = next(d for d in docs if d["kind"] == "PriorityClass" and d["metadata"]["name"] == name)
    assert priority_class["preemptionPolicy"] == "Never" and not priority_class["globalDefault"]
    kustomization = yaml.safe_load((K8S / "exporter" / "kustomization.yaml").read_text())
    assert "priorityclass.yaml" in kustomization["resources"]


@pytest.mark.parametrize("config", [K8S / "gateway" / "config.yaml", K8S / "envoy-gateway" / "config.yaml"])
def test_sidecar_configs_are_valid(config: Path) -> None:
    load_config(config)


def test_envoy_gateway_sidecar_config_refuses_queueing_classes() -> None:
    """Envoy Gateway sets no max_message_timeout, so the sidecar cannot extend Envoy's timer to wait."""
    config = yaml.safe_load((K8S / "envoy-gateway" / "config.yaml").read_text())
    policy = next(doc for _, doc in objects() if doc["kind"] == "EnvoyExtensionPolicy")
    timeout = policy["spec"]["extProc"][0]["messageTimeout"]
    assert config["admission"]["envoy_max_message_timeout_seconds"] == float(timeout.removesuffix("s"))


def test_every_manifest_parses_and_has_kind() -> None:
    files = sorted(K8S.rglob("*.yaml"))
    assert files
    for path in files:
        for doc in yaml.safe_load_all(path.read_text()):
            if path.name in {"config.yaml", "envoy.yaml"}:
                continue
            assert doc and "kind" in doc and "apiVersion" in doc, path


def test_kustomizations_reference_existing_files() -> None:
    for kustomization in K8S.rglob("kustomization.yaml"):
        spec = yaml.safe_load(kustomization.read_text())
        for resource in spec.get("resources", []):
            assert (kustomization.parent / resource).exists(), f"{kustomization}: {resource}"
        for generator in spec.get("configMapGenerator", []):
            for file in generator.get("files", []):
                assert (kustomization.parent / file.split("=")[-1]).exists(), f"{kustomization}: {file}"


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
    for path in K8S.rglob("*.yaml"):
        for doc in yaml.safe_load_all(path.read_text()):
            spec = (doc or {}).get("spec", {}).get("template", {}).get("spec", {})
            for container in spec.get("containers", []):
                assert not container["image"].endswith(":latest"), path
