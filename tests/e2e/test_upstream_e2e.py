"""The Kubernetes gateway's Envoy, run on the files `kubectl kustomize` builds for its pod, forwards to the
engine named in the extproc-upstream ConfigMap alone: plain HTTP and TLS (SNI, the CA beside it), in both
profiles, follows the ConfigMap when the kubelet swaps it in place and keeps the last good engine when the
new file is invalid (k8s/README.md,
extproc/envoyconf/upstream.py).

The pod's files are written under a temporary root, the mount paths rewritten to it, and the ConfigMap's
directory laid out as the kubelet does (a `..data` symlink swapped by a rename). The engine is a small HTTP
server answering `/health`, a route the sidecar is not asked about (no sidecar runs here).
"""

from __future__ import annotations

import http.server
import ssl
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import yaml

from devstack.processes import Ports, Process, envoy_command, wait_http
from extproc.envoyconf.upstream import (
    CA_FILE,
    MOUNT,
    UPSTREAM_FILE,
    EngineAddress,
    discovery_response,
    upstream_cluster,
)
from tests.support.envoy_validate import validate
from tests.unit.k8s.kustomize_build import K8S, built, envoy_files

PROFILES = {"lean": K8S, "inline": K8S / "inline"}
BOOTSTRAP = "/etc/envoy/envoy.yaml"


class _Engine(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = self.server.server_name.encode()  # type: ignore[attr-defined]
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_args: Any) -> None:
        pass


@contextmanager
def engine(name: str, tls: ssl.SSLContext | None = None) -> Iterator[int]:
    """An engine on a free localhost port that answers every GET with its name."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Engine)
    server.server_name = name
    if tls is not None:
        server.socket = tls.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def kubelet_write(directory: Path, files: dict[str, str]) -> None:
    """A ConfigMap volume's update as the kubelet makes it: the files in a new hidden directory, `..data`
    pointed at it by a rename (the move Envoy's watched_directory reacts to), each key a link through it."""
    directory.mkdir(parents=True, exist_ok=True)
    version = directory / f"..{time.monotonic_ns()}"
    version.mkdir()
    for key, text in files.items():
        (version / key).write_text(text)
    (directory / "..data_tmp").symlink_to(version.name)
    (directory / "..data_tmp").rename(directory / "..data")
    for key in files:
        if not (directory / key).is_symlink():
            (directory / key).symlink_to(f"..data/{key}")


class Pod:
    """The gateway pod's Envoy files under `root`, its ports on free ones, its engine where a test puts it."""

    def __init__(self, docs: tuple[dict[str, Any], ...], root: Path) -> None:
        self.root = root
        self.files = envoy_files(docs)
        self.ports = Ports.free()
        self.bootstrap: dict[str, Any] = yaml.safe_load(self.local(self.files[BOOTSTRAP]))
        self.bootstrap["admin"]["address"]["socket_address"]["port_value"] = self.ports.envoy_admin
        listener = self.bootstrap["static_resources"]["listeners"][0]
        listener["address"]["socket_address"].update(address="127.0.0.1", port_value=self.ports.envoy)

    def local(self, text: str) -> str:
        """A file's text with the pod's upstream mount under the root."""
        return text.replace(MOUNT, str(self.root / MOUNT.lstrip("/")))

    def upstream(self, files: dict[str, str]) -> None:
        kubelet_write(self.root / MOUNT.lstrip("/"), {k: self.local(v) for k, v in files.items()})

    def static(self) -> dict[str, Any]:
        """The bootstrap with the CDS file's clusters as static ones: what `--mode validate` checks fully."""
        config: dict[str, Any] = yaml.safe_load(yaml.safe_dump(self.bootstrap))
        response = yaml.safe_load((self.root / MOUNT.lstrip("/") / UPSTREAM_FILE).read_text())
        clusters = [{k: v for k, v in r.items() if k != "@type"} for r in response["resources"]]
        config["static_resources"]["clusters"] += clusters
        del config["dynamic_resources"]
        return config

    @contextmanager
    def envoy(self) -> Iterator[None]:
        path = self.root / "envoy.yaml"
        path.write_text(yaml.safe_dump(self.bootstrap))
        process = Process.start("envoy", envoy_command(path, self.ports.envoy_admin % 60000), self.root)
        try:
            wait_http(f"http://127.0.0.1:{self.ports.envoy_admin}/ready", 30, process)
            yield
        finally:
            process.stop()

    def refused_updates(self) -> int:
        """CDS updates Envoy refused: a file it could not parse, or a cluster it did not accept."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.ports.envoy_admin}/stats", timeout=5) as resp:
            stats = dict(line.split(": ", 1) for line in resp.read().decode().splitlines() if ": " in line)
        return sum(
            int(stats.get(f"cluster_manager.cds.update_{name}", 0)) for name in ("failure", "rejected")
        )

    def get(self, path: str = "/health") -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.ports.envoy}{path}", timeout=5) as resp:
                return resp.status, resp.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()


def cds_file(url: str, **tls: str) -> str:
    return yaml.safe_dump(discovery_response(upstream_cluster(EngineAddress.parse(url, **tls))))


@pytest.mark.parametrize("where", [*PROFILES, "example"])
def test_the_built_pod_files_validate_with_their_engine(where: str, tmp_path: Path) -> None:
    """Each build's bootstrap with its own upstream ConfigMap (the example's: TLS and its CA): Envoy accepts
    the bootstrap as it loads it, and the engine's cluster as a static one (validate mode does not read a
    CDS file's contents)."""
    pod = Pod(built(K8S / "examples" / "my-vllm" if where == "example" else PROFILES[where]), tmp_path)
    pod.upstream({key.rsplit("/", 1)[1]: text for key, text in pod.files.items() if key.startswith(MOUNT)})
    validate(pod.bootstrap, tmp_path)
    validate(pod.static(), tmp_path)


def until(condition: Any, limit_s: float = 15.0) -> bool:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return False


@pytest.mark.parametrize("profile", PROFILES)
def test_envoy_forwards_to_the_configured_engine_and_follows_the_config_map(
    profile: str, tmp_path: Path
) -> None:
    pod = Pod(built(PROFILES[profile]), tmp_path)
    with engine("first") as first, engine("second") as second:
        pod.upstream({UPSTREAM_FILE: cds_file(f"http://127.0.0.1:{first}")})
        with pod.envoy():
            assert pod.get() == (200, "first")
            pod.upstream({UPSTREAM_FILE: cds_file(f"http://localhost:{second}")})
            assert until(lambda: pod.get() == (200, "second")), pod.get()
            # An invalid update (a port past 65535) is refused and the last good engine kept.
            pod.upstream({UPSTREAM_FILE: cds_file(f"http://127.0.0.1:{first}").replace(str(first), "99999")})
            assert until(lambda: pod.refused_updates() > 0)
            assert pod.get() == (200, "second")


def make_ca(directory: Path, name: str) -> tuple[Path, Path, Path]:
    """A CA and a server certificate for `name` signed by it: (ca.crt, server.crt, server.key)."""

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True)

    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes")
    openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", CA_FILE, "-subj", "/CN=test CA", "-days", "1")
    openssl("req", *ec, "-keyout", "server.key", "-out", "server.csr", "-subj", f"/CN={name}")
    (directory / "san.ext").write_text(f"subjectAltName=DNS:{name}\n")
    openssl(
        "x509", "-req", "-in", "server.csr", "-CA", CA_FILE, "-CAkey", "ca.key", "-CAcreateserial",
        "-out", "server.crt", "-days", "1", "-extfile", "san.ext",
    )  # fmt: skip
    return directory / CA_FILE, directory / "server.crt", directory / "server.key"


@pytest.mark.parametrize("profile", PROFILES)
def test_envoy_speaks_tls_to_the_engine_and_checks_its_name(profile: str, tmp_path: Path) -> None:
    (tmp_path / "pki").mkdir()
    ca, cert, key = make_ca(tmp_path / "pki", "localhost")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    pod = Pod(built(PROFILES[profile]), tmp_path)
    with engine("tls", context) as port:
        pod.upstream({UPSTREAM_FILE: cds_file(f"https://localhost:{port}"), CA_FILE: ca.read_text()})
        with pod.envoy():
            assert pod.get() == (200, "tls")
            # A certificate that does not name the SNI is refused: Envoy answers 503 itself.
            wrong = {UPSTREAM_FILE: cds_file(f"https://localhost:{port}", sni="vllm.example.com")}
            pod.upstream({**wrong, CA_FILE: ca.read_text()})
            assert until(lambda: pod.get()[0] == 503), pod.get()
