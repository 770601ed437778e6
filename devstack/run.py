"""`make run` (`python -m devstack`): the local stack in the foreground on the documented ports, its
banner, and Ctrl-C to stop it."""

from __future__ import annotations

import signal
import socket
import sys
import time
from pathlib import Path

import yaml

from devstack.stack import LOCAL_CONFIG, LocalStack
from devstack.upstream import Upstream, UpstreamError
from extproc.envoyconf.profiles import DEFAULT_PROFILE, PROFILES, REPO

BANNER = """
Local stack is up ({profile} profile; `python -m devstack --profile {other}` starts the other one,
docs/architecture.md compares them):
  Envoy (send requests here)  http://127.0.0.1:{envoy}
  Envoy admin                 http://127.0.0.1:{envoy_admin}
  sidecar gRPC (ext_proc)     127.0.0.1:{grpc}
  sidecar metrics             http://127.0.0.1:{admin}/metrics
  {upstream_name:27} {upstream}   (KV usage: /metrics)
  KV-cache exporter           127.0.0.1:{exporter} (feed), http://127.0.0.1:{exporter_metrics}/metrics
  logs and rendered configs   {workdir}

Try:
  curl -s http://127.0.0.1:{envoy}/v1/chat/completions -H 'content-type: application/json' \\
    -d '{{"model":"{model}","max_tokens":64,"messages":[{{"role":"user","content":"Hello"}}]}}'

Fill the cache: twenty long answers where seven fit. The shipped `interactive` class waits up to 25 s
for the KV each needs, so two waves are answered late; what the cache cannot take by then gets a 429
with the reason and a forecast retry-after:
  for i in $(seq 20); do curl -s -o /dev/null \\
    -w '%{{http_code}} %header{{x-extproc-reject-reason}} retry-after %header{{retry-after}}\\n' \\
    http://127.0.0.1:{envoy}/v1/chat/completions -H 'content-type: application/json' \\
    -d '{{"model":"{model}","max_tokens":2000,"messages":[{{"role":"user","content":"Hi"}}]}}' & done; wait
(The limits start at 60 % of the configured ones, the feed's safe scale, and recover within seconds once
the exporter's first samples arrive: `x-ratelimit-limit-*` shows the scaled limits.)

Watch the adaptive scale and the KV budget follow the engine's KV usage:
  curl -s http://127.0.0.1:{admin}/metrics | grep -E '^extproc_(kv_usage|kv_booked|adaptive_scale|limit_conc)'

Edit {config} to change limits; the sidecar reloads it without a restart.
Ctrl-C stops everything.
"""


LOCAL_SIM_ARGS = ("--num-gpu-blocks", "1024")
"""`make run`'s simulator: Llama-3-8B's timing with a 16,384-token cache (1,024 blocks of 16), so a few long
answers fill it and the KV budget, the adaptive scale and `retry-after` visibly act (on the simulator's
default 440,816-token cache the README's load moved KV usage to 4 %)."""


def foreground_stack(
    config: Path | None, profile: str = DEFAULT_PROFILE, upstream: Upstream | None = None
) -> LocalStack:
    """The `make run` stack. The config path is made absolute (the processes run from the repository root)
    but not resolved, so a symlinked config (a ConfigMap layout) is watched through its link. In front of
    an `upstream` without a config of one's own, config/local.yaml fitted to its model is written to the
    stack's directory (and reloaded from there when edited)."""
    workdir = REPO / "run"
    sim_args: tuple[str, ...] = () if upstream is not None else LOCAL_SIM_ARGS
    if upstream is not None and config is None:
        workdir.mkdir(parents=True, exist_ok=True)
        config = workdir / "upstream.yaml"
        fitted = upstream.sidecar_config(yaml.safe_load(LOCAL_CONFIG.read_text()))
        config.write_text(yaml.safe_dump(fitted, sort_keys=False))
    return LocalStack(
        sidecar_config_file=(config or LOCAL_CONFIG).absolute(),
        workdir=workdir,
        with_exporter=True,
        profile=profile,
        upstream=upstream,
        model=upstream.model if upstream is not None else "llama-3-8b",
        sim_args=sim_args,
    )


ROLES = {
    "envoy": "Envoy listener",
    "envoy_admin": "Envoy admin",
    "grpc": "sidecar gRPC",
    "admin": "sidecar admin HTTP",
    "upstream": "simulator",
    "exporter": "exporter feed",
    "exporter_metrics": "exporter metrics",
}


def taken_ports(stack: LocalStack) -> list[str]:
    """The documented ports the stack would listen on that something else holds, each with its role (a
    second `make run`, a vLLM on 8000): named before anything starts, not in a process's log after."""
    taken = []
    for name, role in ROLES.items():
        if name == "upstream" and stack.upstream is not None:
            continue
        port = getattr(stack.ports, name)
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                taken.append(f"127.0.0.1:{port} ({role})")
    return taken


def run_stack(config: Path | None, profile: str = DEFAULT_PROFILE, upstream_url: str | None = None) -> int:
    """Foreground `make run`: start the stack with the documented ports and wait for Ctrl-C."""
    try:
        upstream = Upstream.discover(upstream_url) if upstream_url else None
    except UpstreamError as exc:
        print(f"local stack: {exc}", file=sys.stderr)
        return 1
    stack = foreground_stack(config, profile, upstream)
    taken = taken_ports(stack)
    if taken:
        print(
            f"local stack: in use: {', '.join(taken)}; stop what holds them (another make run?)",
            file=sys.stderr,
        )
        return 1
    try:
        stack.start()
    except (OSError, RuntimeError, TimeoutError) as exc:
        # start() has stopped what it started; a process that died says where its log is in `exc`.
        print(f"local stack failed to start: {exc}", file=sys.stderr)
        return 1
    p = stack.ports
    print(
        BANNER.format(
            envoy=p.envoy,
            envoy_admin=p.envoy_admin,
            grpc=p.grpc,
            admin=p.admin,
            upstream=stack.upstream_url,
            upstream_name="simulator (vLLM-like)" if upstream is None else f"your server ({upstream.model})",
            model=stack.model,
            exporter=p.exporter,
            exporter_metrics=p.exporter_metrics,
            workdir=stack.workdir,
            config=stack.config_path,
            profile=profile,
            other=next(p for p in PROFILES if p != profile),
        ),
        flush=True,
    )
    return supervise(stack)


def supervise(stack: LocalStack, poll_s: float = 0.5) -> int:
    """Wait for Ctrl-C (or SIGTERM), then stop the stack: 0. A process of the stack that dies first stops it
    too, names the process and its log, and makes `make run` fail (1)."""
    stopping = False
    crashed = False

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
                    stopping = crashed = True
            if not stopping:
                time.sleep(poll_s)
    finally:
        print("stopping the local stack", flush=True)
        stack.stop()
    return 1 if crashed else 0
