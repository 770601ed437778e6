"""The Kubernetes manifests hang together: every file parses, every kustomize reference exists."""

from __future__ import annotations

from pathlib import Path

import yaml

from extproc.config import load_config

K8S = Path(__file__).resolve().parents[2] / "k8s"


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
