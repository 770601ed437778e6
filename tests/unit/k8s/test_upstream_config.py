"""In Kubernetes the engine the gateway forwards to is set in one place, the extproc-upstream ConfigMap, and
both profiles' Envoy take it from there; an overlay that replaces that ConfigMap changes the engine and
nothing else. The builds are `kubectl kustomize`'s (tests/unit/k8s/kustomize_build.py); that a real Envoy
accepts and uses the built files is tests/e2e/test_shipped_configs.py."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from envoy.config.cluster.v3 import cluster_pb2
from envoy.extensions.load_balancing_policies.least_request.v3 import least_request_pb2
from google.protobuf import json_format

from extproc.cli import main
from extproc.envoyconf.upstream import (
    CA_FILE,
    MOUNT,
    UPSTREAM_CLUSTER,
    UPSTREAM_FILE,
    EngineAddress,
    UpstreamURLError,
    clusters_of,
    render_upstream_yaml,
    upstream_cluster,
)
from tests.unit.k8s import kustomize_build
from tests.unit.k8s.kustomize_build import K8S, REPO, built, envoy_files, named

EXAMPLE = K8S / "examples" / "my-vllm"
PROFILES = {"lean": K8S, "inline": K8S / "inline"}
BOOTSTRAP = "/etc/envoy/envoy.yaml"
UPSTREAM = f"{MOUNT}/{UPSTREAM_FILE}"
SHIPPED_UPSTREAMS = [K8S / "gateway" / UPSTREAM_FILE, EXAMPLE / UPSTREAM_FILE]


def routed_clusters(node: Any) -> set[str]:
    """Every cluster a route of this config sends requests to."""
    if isinstance(node, dict):
        found = {str(node["cluster"])} if isinstance(node.get("cluster"), str) else set()
        return found.union(*(routed_clusters(v) for v in node.values()))
    if isinstance(node, list):
        return set().union(*(routed_clusters(v) for v in node))
    return set()


def engine_of(files: dict[str, str]) -> dict[str, Any]:
    """The one cluster of the pod's CDS file: the engine."""
    (cluster,) = clusters_of(yaml.safe_load(files[UPSTREAM]))
    return cluster


@pytest.mark.parametrize("profile", PROFILES)
def test_both_profiles_take_the_engine_from_the_upstream_config_map_only(profile: str) -> None:
    docs = built(PROFILES[profile])
    files = envoy_files(docs)
    bootstrap = yaml.safe_load(files[BOOTSTRAP])
    # Envoy's CDS reads the mounted ConfigMap's file, watching its directory for the kubelet's swaps.
    cds = bootstrap["dynamic_resources"]["cds_config"]["path_config_source"]
    assert cds == {"path": UPSTREAM, "watched_directory": {"path": MOUNT}}
    assert bootstrap["node"]["id"] and bootstrap["node"]["cluster"]
    # The bootstrap routes to the engine by name and defines no engine of its own.
    static = {c["name"] for c in bootstrap["static_resources"]["clusters"]}
    assert UPSTREAM_CLUSTER not in static
    assert UPSTREAM_CLUSTER in routed_clusters(bootstrap["static_resources"]["listeners"])
    assert routed_clusters(bootstrap["static_resources"]["listeners"]) <= static | {UPSTREAM_CLUSTER}
    assert engine_of(files) == clusters_of(yaml.safe_load((K8S / "gateway" / UPSTREAM_FILE).read_text()))[0]
    # No other file of the build names the engine.
    host = engine_of(files)["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]
    text = yaml.safe_dump_all(
        d for d in docs if d["metadata"]["name"] != upstream_map(docs)["metadata"]["name"]
    )
    assert host["socket_address"]["address"] not in text


def upstream_map(docs: tuple[dict[str, Any], ...]) -> dict[str, Any]:
    return named(docs, "ConfigMap", "extproc-upstream")


def overlay_on(profile: str, tmp_path: Path) -> tuple[dict[str, Any], ...]:
    """The example overlay applied to one profile's install (copied so that it may name k8s/inline)."""
    spec = yaml.safe_load((EXAMPLE / "kustomization.yaml").read_text())
    assert spec["resources"] == ["../../inline"] and spec["components"] == ["../../gateway/lean"]
    spec["resources"] = [os.path.relpath(K8S / "inline", tmp_path)]
    spec["components"] = [os.path.relpath(K8S / "gateway" / "lean", tmp_path)] if profile == "lean" else []
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump(spec))
    for name in (UPSTREAM_FILE, CA_FILE):
        (tmp_path / name).write_text((EXAMPLE / name).read_text())
    result = subprocess.run(
        [kustomize_build.kubectl(), "kustomize", str(tmp_path)], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    return tuple(doc for doc in yaml.safe_load_all(result.stdout) if doc)


def without_upstream(docs: tuple[dict[str, Any], ...]) -> list[dict[str, Any]]:
    """The build with the upstream ConfigMap's hashed name and content blanked out."""
    name = upstream_map(docs)["metadata"]["name"]
    out = list(yaml.safe_load_all(yaml.safe_dump_all(docs).replace(name, "extproc-upstream")))
    for doc in out:
        if doc["kind"] == "ConfigMap" and doc["metadata"]["name"] == "extproc-upstream":
            doc["data"] = {}
    return out


def test_the_example_overlay_builds_as_shipped_on_the_default_install() -> None:
    assert without_upstream(built(EXAMPLE)) == without_upstream(built(K8S))
    assert envoy_files(built(EXAMPLE))[UPSTREAM] == (EXAMPLE / UPSTREAM_FILE).read_text()


@pytest.mark.parametrize("profile", PROFILES)
def test_the_overlays_engine_is_what_both_profiles_use_and_all_it_changes(
    profile: str, tmp_path: Path
) -> None:
    docs = overlay_on(profile, tmp_path)
    files = envoy_files(docs)
    assert files[UPSTREAM] == (EXAMPLE / UPSTREAM_FILE).read_text()
    assert files[f"{MOUNT}/{CA_FILE}"] == (EXAMPLE / CA_FILE).read_text()
    engine = engine_of(files)
    assert engine == upstream_cluster(EngineAddress.parse("https://vllm.inference.svc.cluster.local:8443"))
    tls = engine["transport_socket"]["typed_config"]
    assert tls["sni"] == "vllm.inference.svc.cluster.local"
    assert tls["common_tls_context"]["validation_context"]["trusted_ca"] == {"filename": f"{MOUNT}/{CA_FILE}"}
    # The rolled pods get the new ConfigMap (its name carries the new content's hash).
    assert (
        upstream_map(docs)["metadata"]["name"] != upstream_map(built(PROFILES[profile]))["metadata"]["name"]
    )
    assert without_upstream(docs) == without_upstream(built(PROFILES[profile]))


def rendering_command(path: Path) -> list[str]:
    """The `envoy-upstream` arguments on a shipped file's first line."""
    first = path.read_text().splitlines()[0]
    command = first.split("`")[1]
    assert command.startswith("python -m extproc envoy-upstream "), first
    return shlex.split(command)[4:]


@pytest.mark.parametrize("shipped", SHIPPED_UPSTREAMS, ids=lambda p: str(p.relative_to(REPO)))
def test_shipped_upstream_files_are_their_rendering(shipped: Path) -> None:
    args = rendering_command(shipped)
    flags = dict(zip(args[1::2], args[2::2], strict=True))
    rendered = render_upstream_yaml(args[0], flags.get("--sni"), flags.get("--ca"))
    assert shipped.read_text() == rendered, f"stale: python -m extproc envoy-upstream {' '.join(args)}"


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("http://vllm.ns.svc:8000", EngineAddress("vllm.ns.svc", 8000)),
        ("http://10.0.0.7", EngineAddress("10.0.0.7", 80)),
        ("https://vllm.ns.svc:8443/", EngineAddress("vllm.ns.svc", 8443, True, "vllm.ns.svc")),
        ("https://vllm.ns.svc", EngineAddress("vllm.ns.svc", 443, True, "vllm.ns.svc")),
    ],
)
def test_engine_urls(url: str, expected: EngineAddress) -> None:
    assert EngineAddress.parse(url) == expected


def test_an_ip_literal_is_static_and_a_name_is_resolved() -> None:
    assert upstream_cluster(EngineAddress.parse("http://10.0.0.7:8000"))["type"] == "STATIC"
    assert upstream_cluster(EngineAddress.parse("http://vllm:8000"))["type"] == "STRICT_DNS"
    assert "transport_socket" not in upstream_cluster(EngineAddress.parse("http://vllm:8000"))


def test_engines_behind_one_name_are_balanced_by_requests_in_flight() -> None:
    """A headless Service resolves to every engine: Envoy sends each request to the one with fewer requests
    in flight (bench/RESULTS.md section 12), its policy a real Envoy message (the wire types' own parser)."""
    cluster = upstream_cluster(EngineAddress.parse("http://vllm-headless:8000"))
    assert "lb_policy" not in cluster  # the deprecated enum
    parsed = json_format.ParseDict(cluster["load_balancing_policy"], cluster_pb2.LoadBalancingPolicy())
    policy = parsed.policies[0].typed_extension_config
    assert policy.name == "envoy.load_balancing_policies.least_request"
    assert policy.typed_config.Is(least_request_pb2.LeastRequest.DESCRIPTOR)


def test_tls_checks_the_certificate_against_the_given_name_and_ca() -> None:
    engine = EngineAddress.parse("https://10.0.0.7:8443", sni="vllm.example.com", ca="/etc/ssl/ca.pem")
    tls = upstream_cluster(engine)["transport_socket"]["typed_config"]
    assert tls["sni"] == "vllm.example.com"
    assert tls["common_tls_context"]["validation_context"] == {
        "trusted_ca": {"filename": "/etc/ssl/ca.pem"},
        "match_typed_subject_alt_names": [{"san_type": "DNS", "matcher": {"exact": "vllm.example.com"}}],
    }


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["ftp://vllm:21"], "give http://HOST:PORT or https://HOST:PORT"),
        (["http://vllm:8000/v1"], "without a path"),
        (["http://vllm:8000", "--sni", "vllm"], "--sni and --ca are for an https engine"),
    ],
)
def test_a_url_envoy_cannot_use_is_refused_with_the_reason(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["envoy-upstream", *argv]) == 2
    assert message in capsys.readouterr().err
    with pytest.raises(UpstreamURLError):
        EngineAddress.parse(argv[0], *([argv[2]] if len(argv) > 2 else []))


README = K8S / "README.md"
ENVOY_GATEWAY = {"lean": K8S / "envoy-gateway" / "lean", "inline": K8S / "envoy-gateway" / "inline"}


def readme_block(marker: str) -> dict[str, Any]:
    """The k8s/README.md YAML block containing `marker`."""
    blocks = re.findall(r"```yaml\n(.*?)```", README.read_text(), re.S)
    (block,) = [yaml.safe_load(b) for b in blocks if marker in b]
    return dict(block)


def test_the_readmes_gateway_overlay_is_the_tested_example() -> None:
    readme = readme_block("configMapGenerator")
    example = yaml.safe_load((EXAMPLE / "kustomization.yaml").read_text())
    assert readme["configMapGenerator"] == example["configMapGenerator"]
    assert readme["resources"] == ["../extproc/k8s"]
    command = re.search(
        r"python -m extproc envoy-upstream (\S+) > my-gateway/upstream.yaml", README.read_text()
    )
    assert command is not None and rendering_command(EXAMPLE / UPSTREAM_FILE) == [command[1]]


def route_backends(docs: tuple[dict[str, Any], ...]) -> list[dict[str, Any]]:
    rules: list[dict[str, Any]] = named(docs, "HTTPRoute", "llm-routes")["spec"]["rules"]
    return [ref for rule in rules for ref in rule["backendRefs"]]


def test_both_envoy_gateway_profiles_route_to_the_engine_of_one_route_rule() -> None:
    lean, inline = (built(path) for path in ENVOY_GATEWAY.values())
    assert route_backends(lean) == route_backends(inline) == [{"name": "vllm", "port": 8000}]
    for docs in (lean, inline):
        rest = [d for d in docs if d["kind"] != "HTTPRoute"]
        assert '"name": "vllm"' not in json.dumps(rest)  # no other object names the engine's Service


@pytest.mark.parametrize("profile", ENVOY_GATEWAY)
def test_the_readmes_envoy_gateway_patch_sets_the_engine(profile: str, tmp_path: Path) -> None:
    overlay = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": [os.path.relpath(ENVOY_GATEWAY[profile], tmp_path)],
        **readme_block("HTTPRoute"),
    }
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump(overlay))
    result = subprocess.run(
        [kustomize_build.kubectl(), "kustomize", str(tmp_path)], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    docs = tuple(doc for doc in yaml.safe_load_all(result.stdout) if doc)
    assert route_backends(docs) == [{"name": "my-vllm", "port": 8000}]
    shipped = built(ENVOY_GATEWAY[profile])
    assert [d for d in docs if d["kind"] != "HTTPRoute"] == [d for d in shipped if d["kind"] != "HTTPRoute"]
