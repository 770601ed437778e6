"""Builds the shipped kustomizations with the real `kubectl kustomize`, so the tests check what
`kubectl apply -k` sends (generated ConfigMaps, name suffixes, namespaces, components), not the source files.

kubectl is required, like the other system programs the tests run (scripts/system-deps.sh checks it): a
missing one, or one whose built-in kustomize is older than v5, fails the tests with the way to install it.
"""

from __future__ import annotations

import functools
import json
import shutil
import subprocess
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[3]
K8S = REPO / "k8s"
MIN_KUSTOMIZE_MAJOR = 5
INSTALL = (
    "install kubectl 1.27 or later (https://kubernetes.io/docs/tasks/tools/); `make system-deps` checks it"
)


def kind_of(directory: Path) -> str:
    """Kustomization or Component (a file without `kind` is a Kustomization, as kustomize reads it)."""
    spec = yaml.safe_load((directory / "kustomization.yaml").read_text())
    return str(spec.get("kind", "Kustomization"))


def roots(kind: str) -> list[Path]:
    """Every shipped directory whose kustomization.yaml is of this kind, sorted."""
    found = (path.parent for path in K8S.rglob("kustomization.yaml"))
    return sorted(directory for directory in found if kind_of(directory) == kind)


@functools.cache
def kubectl() -> str:
    path = shutil.which("kubectl")
    if path is None:
        pytest.fail(f"kubectl is not installed: {INSTALL}", pytrace=False)
    version = json.loads(
        subprocess.run([path, "version", "--client", "-o", "json"], capture_output=True, check=True).stdout
    )
    major = int(version.get("kustomizeVersion", "v0").lstrip("v").split(".")[0] or 0)
    if major < MIN_KUSTOMIZE_MAJOR:
        pytest.fail(f"kubectl bundles kustomize {version.get('kustomizeVersion')}: {INSTALL}", pytrace=False)
    return path


@functools.cache
def built(directory: Path) -> tuple[dict[str, Any], ...]:
    """The objects `kubectl kustomize <directory>` prints; a failing build fails with kustomize's message."""
    result = subprocess.run(
        [kubectl(), "kustomize", str(directory)], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, f"kubectl kustomize {directory.relative_to(REPO)}: {result.stderr.strip()}"
    return tuple(doc for doc in yaml.safe_load_all(result.stdout) if doc)


def built_objects() -> list[tuple[str, dict[str, Any]]]:
    """Every object of every shipped kustomization's build, once each, with the first build it came from."""
    seen: set[str] = set()
    found = []
    for directory in roots("Kustomization"):
        for doc in built(directory):
            key = json.dumps(doc, sort_keys=True)
            if key not in seen:
                seen.add(key)
                found.append((str(directory.relative_to(REPO)), doc))
    return found


def named(docs: tuple[dict[str, Any], ...], kind: str, prefix: str) -> dict[str, Any]:
    """The one object of this kind whose name starts with prefix (generated names carry a hash suffix)."""
    matches = [d for d in docs if d["kind"] == kind and d["metadata"]["name"].startswith(prefix)]
    assert len(matches) == 1, f"{len(matches)} {kind} named {prefix}*"
    return matches[0]


def envoy_files(docs: tuple[dict[str, Any], ...]) -> dict[str, str]:
    """The files the gateway pod's Envoy container reads, by their path in the container: every key of every
    ConfigMap it mounts (the bootstrap, the engine's cluster file, its CA)."""
    pod = named(docs, "Deployment", "extproc-gateway")["spec"]["template"]["spec"]
    envoy = next(c for c in pod["containers"] if c["name"] == "envoy")
    volumes = {v["name"]: v for v in pod["volumes"]}
    files: dict[str, str] = {}
    for mount in envoy["volumeMounts"]:
        config_map = named(docs, "ConfigMap", volumes[mount["name"]]["configMap"]["name"])
        assert config_map["metadata"]["name"] == volumes[mount["name"]]["configMap"]["name"]
        for key, text in config_map["data"].items():
            files[f"{mount['mountPath']}/{key}"] = text
    return files


def sidecar_deployments(
    docs: tuple[dict[str, Any], ...],
) -> list[tuple[dict[str, Any], dict[str, Any] | None]]:
    """Each Deployment of a build that runs the admission sidecar (`extproc serve --config PATH`), with the
    config it reads there: PATH's file in the ConfigMap mounted at PATH's folder, as the kubelet mounts it;
    None where the build does not ship that ConfigMap (a part, such as k8s/envoy-gateway/base, whose
    overlays add it)."""
    maps = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ConfigMap"}
    found: list[tuple[dict[str, Any], dict[str, Any] | None]] = []
    for deployment in (d for d in docs if d["kind"] == "Deployment"):
        pod = deployment["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        for container in pod["containers"]:
            args = container.get("args", [])
            if args[:1] != ["serve"] or "--config" not in args:
                continue
            path = PurePosixPath(args[args.index("--config") + 1])
            mount = next(m for m in container["volumeMounts"] if PurePosixPath(m["mountPath"]) == path.parent)
            config_map = maps.get(volumes[mount["name"]]["configMap"]["name"])
            text = None if config_map is None else config_map["data"][path.name]
            found.append((deployment, None if text is None else yaml.safe_load(text)))
    return found
