"""The image's install steps, run as close to the Dockerfile as these machines allow, and each entry point the
manifests start, started from what they installed.

No base image can be pulled here, so the real `docker build` is documented (README, "The image") and not
run. This test does what the Dockerfile's build stage does: copies exactly the files its COPY lines name into
an empty directory and runs its `pip install --prefix` there, with `--no-deps --no-build-isolation` added
because nothing can be downloaded (the dependencies and setuptools come from the test venv). The installed
package is then run with `python -S` from an empty working directory, its dependencies on the path but not
the checkout (nor the venv's editable install of it): a module or data file the image's COPY lines or the
package data leave out fails here as it would in the pod.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from devstack.processes import free_port, wait_http

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "Dockerfile"
MANIFESTS = [
    REPO / "k8s" / "gateway" / "deployment.yaml",
    REPO / "k8s" / "envoy-gateway" / "base" / "deployment.yaml",
    REPO / "k8s" / "exporter" / "daemonset.yaml",
]
KUBE_ONLY = ("--kube-", "--pod-", "--relist-seconds")
"""Exporter options that need the Kubernetes API (pod discovery on the node); a static target stands in."""


def dockerfile_steps() -> tuple[list[str], list[str], list[str]]:
    """The build stage's COPY sources and pip install arguments, and the image's ENTRYPOINT + CMD."""
    copies: list[str] = []
    pip: list[str] = []
    entry: list[str] = []
    stage = 0
    for line in DOCKERFILE.read_text().splitlines():
        word, _, rest = line.partition(" ")
        if word == "FROM":
            stage += 1
        elif word == "COPY" and stage == 1:
            copies += shlex.split(rest)[:-1]
        elif word == "RUN" and stage == 1 and "pip install" in rest:
            pip = shlex.split(rest)[shlex.split(rest).index("install") + 1 :]
        elif word in ("ENTRYPOINT", "CMD"):
            entry += yaml.safe_load(rest)
    return copies, pip, entry


def manifest_commands() -> list[list[str]]:
    """Each container command of the image in the manifests (its ENTRYPOINT + CMD where they set none)."""
    _, _, entry = dockerfile_steps()
    commands: list[list[str]] = []
    for path in MANIFESTS:
        for doc in yaml.safe_load_all(path.read_text()):
            spec: dict[str, Any] = doc["spec"]["template"]["spec"]
            for container in spec["containers"]:
                if container["image"].startswith("extproc:"):
                    command = container.get("command", entry[:3])
                    commands.append([*command, *container.get("args", entry[3:])])
    return commands


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The Dockerfile's build stage in a temporary directory; yields the installed site-packages."""
    copies, pip, _ = dockerfile_steps()
    assert pip[-1] == "." and any(arg.startswith("--prefix=") for arg in pip), pip
    work = tmp_path_factory.mktemp("image")
    src = work / "src"
    src.mkdir()
    for name in copies:
        source = REPO / name
        if source.is_dir():
            shutil.copytree(source, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(source, src / name)
    prefix = work / "install"
    args = [arg if not arg.startswith("--prefix=") else f"--prefix={prefix}" for arg in pip[:-1]]
    offline = ["--no-deps", "--no-build-isolation", "--quiet"]
    subprocess.run([sys.executable, "-m", "pip", "install", *args, *offline, str(src)], check=True)
    (site,) = prefix.glob("lib/python*/site-packages")
    yield site


def run_installed(site: Path, command: list[str], cwd: Path) -> subprocess.Popen[bytes]:
    """`command` (`python -m ...`) on the installed package, the test venv's dependencies on the path."""
    assert command[:2] == ["python", "-m"], command
    deps = sysconfig.get_paths()["purelib"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), deps]), "NODE_NAME": "node-a"}
    log = (cwd / "log.txt").open("wb")
    return subprocess.Popen([sys.executable, "-S", *command[1:]], cwd=cwd, env=env, stdout=log, stderr=log)


def test_the_manifests_start_only_the_two_entry_points_this_test_runs() -> None:
    modules = sorted({tuple(command[:3]) for command in manifest_commands()})
    assert modules == [("python", "-m", "extproc"), ("python", "-m", "extproc.kvfeed.exporter")]


def test_the_installed_package_is_the_copy_not_the_checkout(installed: Path, tmp_path: Path) -> None:
    probe = "import extproc, extproc.envoyconf.lean as m; print(extproc.__file__); print(m.lua_source()[:2])"
    deps = sysconfig.get_paths()["purelib"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(installed), deps])}
    out = subprocess.run(
        [sys.executable, "-S", "-c", probe], cwd=tmp_path, env=env, check=True, capture_output=True, text=True
    ).stdout.splitlines()
    assert Path(out[0]).is_relative_to(installed), out  # not REPO: the Lua reader is package data
    assert out[1], out


@pytest.mark.parametrize("command", manifest_commands(), ids=lambda c: " ".join(c[:3]))
def test_each_manifest_command_starts_from_the_install(
    installed: Path, tmp_path: Path, command: list[str]
) -> None:
    admin = free_port()
    if command[2] == "extproc":  # the sidecar: the shipped ConfigMap's config, on free local ports
        config = yaml.safe_load((REPO / "k8s" / "gateway" / "config.yaml").read_text())
        config["server"] |= {"grpc_listen": f"127.0.0.1:{free_port()}", "admin_listen": f"127.0.0.1:{admin}"}
        (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
        command = [arg if arg != "/etc/extproc/config.yaml" else "config.yaml" for arg in command]
    else:  # the exporter: the DaemonSet's options without the Kubernetes API, a static target instead
        kept = [arg for arg in command[3:] if not arg.startswith(KUBE_ONLY)]
        ports = {"--grpc-address": f"127.0.0.1:{free_port()}", "--metrics-address": f"127.0.0.1:{admin}"}
        kept = [
            f"{arg.split('=')[0]}={ports[arg.split('=')[0]]}" if arg.split("=")[0] in ports else arg
            for arg in kept
        ]
        target = f"url=http://127.0.0.1:{free_port()}/metrics,kind=vllm,model=m"
        command = [*command[:3], *kept, f"--target={target}"]
    proc = run_installed(installed, command, tmp_path)
    try:
        wait_http(f"http://127.0.0.1:{admin}/healthz", timeout_s=60)
        assert proc.poll() is None, (tmp_path / "log.txt").read_text()
    finally:
        proc.terminate()
        proc.wait(30)
