"""The shipped kustomizations build with the real `kubectl kustomize`, and build what the README says.

`kubectl apply -k k8s/` must give the lean profile and `k8s/inline/` the inline one, differing only in Envoy's
bootstrap; every manifest file must reach some build (a file no kustomization names is never applied); every
`kubectl apply -k` path in the README must be one of the builds tested here. test_manifests.py validates the
built objects against the API server's schemas.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from extproc.admission.vocabulary.names import NAMESPACE as NAMESPACE_METADATA
from extproc.cli import main
from extproc.config import config_warnings, parse_config
from extproc.envoyconf.lean import lua_source
from extproc.store.settings import RedisSettings
from tests.unit.k8s import kustomize_build
from tests.unit.k8s.kustomize_build import K8S, REPO, built, built_objects, named, roots, sidecar_deployments

NOT_OBJECTS = {"config.yaml", "envoy.yaml", "kustomization.yaml", "upstream.yaml"}
NAMESPACE = "extproc"
CLUSTER_SCOPED = {"Namespace", "PriorityClass", "ClusterRole", "ClusterRoleBinding"}


def where(directory: Path) -> str:
    return str(directory.relative_to(REPO))


@pytest.mark.parametrize("directory", roots("Kustomization"), ids=where)
def test_every_kustomization_builds(directory: Path) -> None:
    assert built(directory)


def test_a_missing_kubectl_fails_with_the_way_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Never a skip: without kubectl nothing here is tested, so the tests say how to get it."""
    # The module kustomize_build looks kubectl up with.
    monkeypatch.setattr(shutil, "which", lambda _name: None)
    kustomize_build.kubectl.cache_clear()
    try:
        with pytest.raises(pytest.fail.Exception, match=r"kubectl is not installed: install kubectl 1\.27"):
            kustomize_build.kubectl()
    finally:
        kustomize_build.kubectl.cache_clear()


def test_every_component_is_named_by_a_kustomization() -> None:
    """A Component cannot be built alone: it is tested through the kustomizations that name it."""
    named_components = set()
    for directory in roots("Kustomization"):
        spec = yaml.safe_load((directory / "kustomization.yaml").read_text())
        named_components |= {(directory / c).resolve() for c in spec.get("components", [])}
    assert set(roots("Component")) <= named_components


def identity(doc: dict[str, Any]) -> tuple[str, str, str]:
    return doc["apiVersion"], doc["kind"], doc["metadata"]["name"]


def test_every_manifest_file_reaches_a_build() -> None:
    built_ids = {identity(doc) for _, doc in built_objects()}
    for path in sorted(K8S.rglob("*.yaml")):
        if path.name in NOT_OBJECTS:
            continue
        for doc in yaml.safe_load_all(path.read_text()):
            assert identity(doc) in built_ids, f"{path.relative_to(REPO)}: {identity(doc)} is in no build"


def envoy_bootstrap(directory: Path) -> str:
    """The envoy.yaml of the gateway pod's Envoy ConfigMap in this build, checked to be the one it mounts."""
    docs = built(directory)
    config_map = named(docs, "ConfigMap", "extproc-envoy")
    pod = named(docs, "Deployment", "extproc-gateway")["spec"]["template"]["spec"]
    volume = next(v for v in pod["volumes"] if v["name"] == "envoy-config")
    assert volume["configMap"]["name"] == config_map["metadata"]["name"]
    return str(config_map["data"]["envoy.yaml"])


def test_apply_k8s_gives_the_lean_profile_and_inline_the_inline_one() -> None:
    assert envoy_bootstrap(K8S) == (K8S / "gateway" / "lean" / "envoy.yaml").read_text()
    assert envoy_bootstrap(K8S / "inline") == (K8S / "gateway" / "envoy.yaml").read_text()


def without_envoy_bootstrap(directory: Path) -> list[dict[str, Any]]:
    """The build with the Envoy ConfigMap's hashed name and content blanked out."""
    text = yaml.safe_dump_all(built(directory))
    name = named(built(directory), "ConfigMap", "extproc-envoy")["metadata"]["name"]
    docs = list(yaml.safe_load_all(text.replace(name, "extproc-envoy")))
    for doc in docs:
        if doc["kind"] == "ConfigMap" and doc["metadata"]["name"] == "extproc-envoy":
            doc["data"] = {}
    return docs


def test_the_two_profiles_differ_only_in_envoys_bootstrap() -> None:
    assert without_envoy_bootstrap(K8S) == without_envoy_bootstrap(K8S / "inline")


@pytest.mark.parametrize("directory", [K8S, K8S / "inline"], ids=where)
def test_every_namespaced_object_lands_in_the_extproc_namespace(directory: Path) -> None:
    for doc in built(directory):
        if doc["kind"] in CLUSTER_SCOPED:
            assert "namespace" not in doc["metadata"], identity(doc)
        else:
            assert doc["metadata"].get("namespace") == NAMESPACE, identity(doc)


def test_the_readmes_deploy_commands_are_the_tested_builds() -> None:
    readme = (REPO / "README.md").read_text()
    commands = re.findall(r"kubectl apply -k ([\w./-]+)", readme)
    assert commands, "README.md names no `kubectl apply -k` command"
    kustomizations = set(roots("Kustomization"))
    for path in commands:
        assert (REPO / path).resolve() in kustomizations, f"README.md: kubectl apply -k {path} is not tested"


ENVOY_GATEWAY_LEAN = K8S / "envoy-gateway" / "lean"


def test_apply_envoy_gateway_gives_its_lean_profile() -> None:
    assert built(K8S / "envoy-gateway") == built(ENVOY_GATEWAY_LEAN)


def test_envoy_gateway_lean_ships_the_packaged_lua_reader() -> None:
    """kustomize reads files only below the kustomization: the copy must stay the packaged reader."""
    lua = named(built(ENVOY_GATEWAY_LEAN), "ConfigMap", "extproc-lean-lua")
    assert lua["data"]["lua"] == lua_source()
    policy = named(built(ENVOY_GATEWAY_LEAN), "EnvoyExtensionPolicy", "extproc-admission")
    assert policy["spec"]["lua"] == [
        {"type": "ValueRef", "valueRef": {"group": "", "kind": "ConfigMap", "name": lua["metadata"]["name"]}}
    ]


def test_envoy_gateway_lean_wires_metadata_reports_and_store_together() -> None:
    docs = built(ENVOY_GATEWAY_LEAN)
    ext_proc = named(docs, "EnvoyExtensionPolicy", "extproc-admission")["spec"]["extProc"][0]
    assert "response" not in ext_proc["processingMode"]  # no response phase: the Lua reader reads it
    assert ext_proc["metadata"]["writableNamespaces"] == [NAMESPACE_METADATA]
    service = named(docs, "Service", "extproc-admission")
    grpc_port = next(p["port"] for p in service["spec"]["ports"] if p["name"] == "grpc")
    proxy = named(docs, "EnvoyProxy", "extproc-lean")
    sink = proxy["spec"]["telemetry"]["accessLog"]["settings"][0]["sinks"][0]["als"]
    assert sink["backendRefs"] == [{"name": "extproc-admission", "port": grpc_port}]
    gateway = named(docs, "Gateway", "llm-gateway")
    assert gateway["spec"]["infrastructure"]["parametersRef"]["name"] == "extproc-lean"
    config = parse_config(yaml.safe_load((ENVOY_GATEWAY_LEAN / "config.yaml").read_text()))
    store = named(docs, "Service", "extproc-store")
    assert config.store.backend == "redis"
    assert isinstance(config.store.options, RedisSettings)
    assert (
        config.store.options.url == f"redis://extproc-store.extproc.svc:{store['spec']['ports'][0]['port']}/0"
    )
    assert named(docs, "Deployment", "extproc-admission")["spec"]["replicas"] == 2
    assert config.store.fallback_share == 0.5


def sidecar_configs(docs: tuple[dict[str, Any], ...]) -> list[dict[str, Any]]:
    """The admission sidecar's config files a build ships (a ConfigMap's `config.yaml`)."""
    maps = (d for d in docs if d["kind"] == "ConfigMap" and "config.yaml" in d.get("data", {}))
    return [yaml.safe_load(d["data"]["config.yaml"]) for d in maps]


def applied() -> list[Path]:
    """What an operator applies: each README `kubectl apply -k` build that ships the sidecar's config (the
    others are building blocks of these, or attach to a sidecar one of these ships)."""
    paths = re.findall(r"kubectl apply -k ([\w./-]+)", (REPO / "README.md").read_text())
    found = sorted({(REPO / path).resolve() for path in paths})
    return [directory for directory in found if sidecar_configs(built(directory))]


@pytest.mark.parametrize("directory", applied(), ids=where)
def test_every_shipped_sidecar_subscribes_to_the_exporter_it_ships_with(directory: Path) -> None:
    """The protection runs as installed: the feed subscribes to the exporter Service of the same build (its
    headless name, namespace and gRPC port, selecting the exporter DaemonSet's pods), the KV budget is on, and
    the config passes check-config without a warning."""
    docs = built(directory)
    service = named(docs, "Service", "extproc-kv-exporter")
    daemonset = named(docs, "DaemonSet", "extproc-kv-exporter")
    port = next(p["port"] for p in service["spec"]["ports"] if p["name"] == "grpc-feed")
    address = f"{service['metadata']['name']}.{service['metadata']['namespace']}.svc:{port}"
    labels = daemonset["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"].items() <= labels.items()
    for raw in sidecar_configs(docs):
        assert raw["feedback"]["service"] == address
        config = parse_config(raw)
        assert config.feedback is not None and config.feedback.kv_budget.enabled
        assert config_warnings(config) == []


def readme_image_overlay() -> dict[str, Any]:
    """The README's own kustomization for a pushed image (the YAML block with `images:`)."""
    blocks = re.findall(r"```yaml\n(.*?)```", (REPO / "README.md").read_text(), re.S)
    (overlay,) = [yaml.safe_load(block) for block in blocks if "\nimages:" in block]
    return dict(overlay)


@pytest.mark.parametrize("install", ["k8s", "k8s/inline", "k8s/envoy-gateway"])
def test_the_readmes_image_override_reaches_every_extproc_container(install: str, tmp_path: Path) -> None:
    """kustomize's `images:` matches the image name and sets name and tag in every container using it
    (https://kubectl.docs.kubernetes.io/references/kustomize/kustomization/images/): the sidecar and the
    exporter take the pushed image, nothing else changes."""
    overlay = readme_image_overlay()
    (image,) = overlay["images"]
    assert overlay["resources"] == ["../extproc/k8s"]  # the README's example: the default install
    overlay["resources"] = [os.path.relpath(REPO / install, tmp_path)]
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump(overlay))
    result = subprocess.run(
        [kustomize_build.kubectl(), "kustomize", str(tmp_path)], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    docs = [doc for doc in yaml.safe_load_all(result.stdout) if doc]
    pushed = f"{image['newName']}:{image['newTag']}"

    def images(objects: Any) -> list[str]:
        return [
            container["image"]
            for doc in objects
            if doc["kind"] in ("Deployment", "DaemonSet")
            for container in doc["spec"]["template"]["spec"]["containers"]
        ]

    shipped = images(built(REPO / install))
    assert shipped.count("extproc:0.1.0") >= 2  # the sidecar and the exporter
    assert images(docs) == [pushed if name == "extproc:0.1.0" else name for name in shipped]


def installs() -> list[Path]:
    """The builds an operator applies whole: those that ship their namespace, and the README's `kubectl apply
    -k` paths. Their parts (k8s/gateway, k8s/store, k8s/exporter) are checked through them: k8s/gateway names
    the store of namespace extproc, which the install that includes it ships."""
    shipping = {d for d in roots("Kustomization") if any(doc["kind"] == "Namespace" for doc in built(d))}
    return sorted(shipping | set(applied()))


def selects(selector: dict[str, str], workload: dict[str, Any]) -> bool:
    """Whether a label selector picks the pods of this Deployment."""
    labels: dict[str, str] = workload["spec"]["template"]["metadata"]["labels"]
    return selector.items() <= labels.items()


def service_named_by(docs: tuple[dict[str, Any], ...], url: str, namespace: str) -> dict[str, Any]:
    """The Service of this build a store URL's host and port resolve to in cluster DNS (`name`,
    `name.namespace`, `name.namespace.svc`, `name.namespace.svc.cluster.local`)."""
    parts = urlsplit(url)
    labels = (parts.hostname or "").split(".")
    assert labels[2:] in ([], ["svc"], ["svc", "cluster", "local"]), f"{url}: not a cluster Service name"
    name, where = labels[0], labels[1] if len(labels) > 1 else namespace
    services = [
        d
        for d in docs
        if d["kind"] == "Service"
        and d["metadata"]["name"] == name
        and d["metadata"].get("namespace") == where
    ]
    assert services, f"{url}: the build ships no Service {name} in namespace {where}"
    ports = [p["port"] for p in services[0]["spec"]["ports"]]
    assert (parts.port or 6379) in ports, f"{url}: Service {name} serves ports {ports}"
    return services[0]


def server_flags(container: dict[str, Any]) -> dict[str, str]:
    """`--name value` pairs of a Redis/Valkey server's command line."""
    words = [*container.get("command", []), *container.get("args", [])]
    return {word: value for word, value in zip(words, [*words[1:], ""], strict=True) if word.startswith("--")}


def check_store_pods(docs: tuple[dict[str, Any], ...], service: dict[str, Any]) -> None:
    """The store behind the Service runs as shipped stores must: ready only when it answers, sized, never
    evicting (the sidecar refuses to admit through a store that may evict: extproc/store/redis/guard.py),
    bounded in memory, non-root, and with a disruption budget."""
    selector = service["spec"]["selector"]
    (deployment,) = [d for d in docs if d["kind"] == "Deployment" and selects(selector, d)]
    pod = deployment["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    for container in pod["containers"]:
        name = container["name"]
        assert container.get("readinessProbe"), f"store container {name}: no readiness probe"
        resources = container.get("resources", {})
        assert {"cpu", "memory"} <= resources.get("requests", {}).keys(), f"store container {name}: requests"
        assert "memory" in resources.get("limits", {}), f"store container {name}: no memory limit"
        flags = server_flags(container)
        assert flags.get("--maxmemory-policy") == "noeviction", f"store container {name}: {flags}"
        assert flags.get("--maxmemory"), f"store container {name}: no maxmemory, {flags}"
    budgets = [
        d
        for d in docs
        if d["kind"] == "PodDisruptionBudget" and selects(d["spec"]["selector"]["matchLabels"], deployment)
    ]
    assert budgets, f"store Deployment {deployment['metadata']['name']}: no PodDisruptionBudget"


@pytest.mark.parametrize("directory", installs(), ids=where)
def test_every_install_with_several_sidecar_replicas_ships_the_store_they_share(directory: Path) -> None:
    """Without a shared store every replica enforces the ConfigMap's limits on its own: two replicas put
    twice the limits in front of the engine, and nothing else says so. So an install that runs the sidecar in
    more than one replica names `store.backend: redis` in the ConfigMap the Deployment mounts, on a Service
    the same build ships, and falls back to at most 1 / replicas of each limit while the store is away. An
    install that expected an external store would have to be listed here with why; none does."""
    docs = built(directory)
    for deployment, raw in sidecar_deployments(docs):
        replicas = deployment["spec"].get("replicas", 1)
        if replicas == 1:
            continue
        name = deployment["metadata"]["name"]
        assert raw is not None, f"{name}: {replicas} replicas and the build ships no config for them"
        config = parse_config(raw)
        assert config.store.backend == "redis", (
            f"{name}: {replicas} replicas without a shared store enforce {replicas} x every limit"
        )
        assert isinstance(config.store.options, RedisSettings)
        assert config.store.fallback_share * replicas <= 1, f"{name}: fallback_share over 1 / {replicas}"
        service = service_named_by(docs, config.store.options.url, deployment["metadata"]["namespace"])
        check_store_pods(docs, service)


@pytest.mark.parametrize("directory", installs(), ids=where)
def test_every_shipped_config_passes_check_config_strict_for_its_replicas(
    directory: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The CI gate an operator runs on an edited ConfigMap passes on the shipped one, for the replicas the
    install runs: no warning, and a store the replicas share."""
    for deployment, raw in sidecar_deployments(built(directory)):
        if raw is None:
            continue
        path = tmp_path / "config.yaml"
        path.write_text(yaml.safe_dump(raw))
        replicas = str(deployment["spec"].get("replicas", 1))
        assert main(["check-config", str(path), "--replicas", replicas, "--strict"]) == 0, capsys.readouterr()


def test_the_default_install_runs_several_sidecar_replicas() -> None:
    """What makes the store test above bite on the default install (and Envoy Gateway's)."""
    for directory in (K8S, K8S / "envoy-gateway"):
        assert directory in installs()
        assert [d["spec"]["replicas"] for d, _ in sidecar_deployments(built(directory))] == [2]
