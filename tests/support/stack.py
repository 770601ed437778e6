"""The local stack as e2e tests see it: plain HTTP calls, Prometheus scrapes, and a started stack with the
sidecar's and the simulator's counters at hand. The fixtures that start and stop stacks are in
tests/e2e/conftest.py."""

from __future__ import annotations

import contextlib
import copy
import json
import socket
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict, Unpack

import openai
from prometheus_client.parser import text_string_to_metric_families

from devstack.envoy import trust_client_tenant_header
from devstack.processes import Ports, Process, free_port, wait_http
from devstack.stack import LocalStack
from extproc.envoyconf.bootstrap import http_connection_managers
from extproc.envoyconf.lean import EXTPROC_CLUSTER


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)

    def data_frames(self) -> list[bytes]:
        """The payloads of an SSE body's `data:` frames, in order."""
        return [f[len(b"data: ") :] for f in self.body.split(b"\n\n") if f.startswith(b"data: ")]


def http(
    method: str,
    url: str,
    body: Any = None,
    headers: dict[str, str] | None = None,
    raw: bytes | None = None,
    timeout_s: float = 60.0,
) -> Reply:
    """A plain HTTP call that returns error statuses instead of raising (`timeout_s`: per socket read)."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    request = urllib.request.Request(url, data=data, method=method)
    request.add_header("content-type", "application/json")
    for key, value in (headers or {}).items():
        request.add_header(key, value)
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            return Reply(resp.status, {k.lower(): v for k, v in resp.headers.items()}, resp.read())
    except urllib.error.HTTPError as err:
        return Reply(err.code, {k.lower(): v for k, v in err.headers.items()}, err.read())


SLOW_READER_RCVBUF = 4096
"""A slow reader's receive buffer: small, so that the answer it has not read waits in front of it."""


def slow_reader_post(port: int, path: str, body: dict[str, Any], timeout_s: float = 30.0) -> socket.socket:
    """A raw HTTP/1.1 client on 127.0.0.1:`port` that has sent `body` to `path` with a 4 KiB receive buffer:
    its caller reads the answer as slowly as it likes.

    The buffer is set before connecting, so the window the handshake advertises fits it. Set after, the
    loopback sender keeps filling a window sized for the default buffer, the kernel drops what overflows
    the small one, and the sender's retransmissions back off, doubling: a reader of 1 KiB every 0.1 s
    waited 3-5 s for a byte here (30 s in one CI run), a stall of the test's own making."""
    data = json.dumps(body).encode()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SLOW_READER_RCVBUF)
    sock.settimeout(timeout_s)
    sock.connect(("127.0.0.1", port))
    sock.sendall(
        f"POST {path} HTTP/1.1\r\nhost: gateway\r\ncontent-type: application/json\r\n".encode()
        + f"content-length: {len(data)}\r\n\r\n".encode()
        + data
    )
    return sock


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = http("GET", url).body.decode()
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = float(sample.value)
    return out


def metric(url: str, name: str, **labels: str) -> float:
    """Sum of the samples named `name` whose labels include `labels`."""
    total = 0.0
    for (sample, sample_labels), value in scrape(url).items():
        if sample == name and all(dict(sample_labels).get(k) == v for k, v in labels.items()):
            total += value
    return total


def wait_fed(stack: LocalStack, limit_s: float = 30.0, capacity_tokens: float = 1.0) -> None:
    """Until the sidecar has read the engines through the KV feed (at least `capacity_tokens` of capacity
    known: every engine of a pool, where a test runs several). A request admitted before the feed's first
    sample starts before any engine reading, so the engines' count cannot reach back to it and it is charged
    an estimate: a test about counted charges sends only after this."""
    sidecar = f"{stack.admin_url}/metrics"
    deadline = time.monotonic() + limit_s
    while metric(sidecar, "extproc_kv_capacity_tokens") < capacity_tokens:
        assert time.monotonic() < deadline, f"the KV feed never reported the engines within {limit_s}s"
        time.sleep(0.1)


class Stack:
    def __init__(self, stack: LocalStack) -> None:
        self.stack = stack
        self.url = stack.envoy_url

    def sidecar(self, name: str, **labels: str) -> float:
        return metric(f"{self.stack.admin_url}/metrics", name, **labels)

    def upstream(self, name: str, **labels: str) -> float:
        return metric(f"{self.stack.upstream_url}/metrics", name, **labels)

    def upstream_requests(self) -> float:
        """Requests that reached the simulator: finished for any reason, or still running or queued."""
        return (
            self.upstream("vllm:request_success_total")
            + self.upstream("vllm:num_requests_running")
            + self.upstream("vllm:num_requests_waiting")
        )


def add_grpc_cluster(config: dict[str, Any], name: str, port: int) -> None:
    """A copy of the sidecar's gRPC cluster (its HTTP/2 options and timeouts) named `name`, to a server on
    `port`: what an Envoy patch points a second ext_proc filter or a logger at."""
    clusters = config["static_resources"]["clusters"]
    sidecar = next(c for c in clusters if c["name"] == EXTPROC_CLUSTER)
    other = copy.deepcopy(sidecar)
    other["name"] = other["load_assignment"]["cluster_name"] = name
    address = other["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]
    address["socket_address"]["port_value"] = port
    clusters.append(other)


@contextlib.contextmanager
def another_simulator(workdir: Path, sim_args: Sequence[str]) -> Iterator[tuple[str, int]]:
    """A simulator beside a stack's own (a second engine of its pool), healthy on entry, stopped on exit:
    its URL and port."""
    port = free_port()
    argv = [sys.executable, "-m", "extproc.sim", "--host", "127.0.0.1", "--port", str(port), *sim_args]
    second = Process.start("simulator-b", argv, workdir)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(f"{url}/health", proc=second)
        yield url, port
    finally:
        second.stop()


def fixed_step_sim(model: str, step_ms: float, *extra: str) -> list[str]:
    """Simulator arguments for a decode step of `step_ms` whatever the batch and no prefill cost, so a test
    knows how long an answer streams (tokens x step)."""
    steady = ["--step-base-ms", f"{step_ms:g}", "--decode-per-seq-ms", "0", "--prefill-per-token-ms", "0"]
    return ["--model", model, *extra, *steady]


EnvoyPatch = Callable[[dict[str, Any]], None]


class StackOptions(TypedDict, total=False):
    """What a test may set on a local stack beyond its config, simulator arguments and profile; an option
    left out keeps LocalStack's default (`envoy_patch`: the tests' tenant-header trust, see `build_stack`)."""

    envoy_patch: EnvoyPatch | None
    ports: Ports
    envoy_template: Path
    with_exporter: bool
    exporter_args: Sequence[str]
    with_simulator: bool
    model: str
    workdir: Path
    sidecar_config_file: Path


def build_stack(
    config: dict[str, Any] | None = None,
    sim_args: Sequence[str] = (),
    profile: str = "inline",
    **options: Unpack[StackOptions],
) -> LocalStack:
    """The one way a test builds a local stack, not yet started (a test that wires a port or a process in
    before `start()` needs it so), on free ports unless given some. By default its clients name their tenant
    in the tenant header (no authn filter sets it here; tests/e2e/test_edge_e2e.py covers the strip itself):
    a suite that runs Envoy without that trust passes `envoy_patch=None` or its own patch."""
    settings: dict[str, Any] = {"envoy_patch": trust_client_tenant_header, **options}
    if "ports" not in settings:  # not setdefault: its argument would pick seven ports for nothing
        settings["ports"] = Ports.free()
    return LocalStack(sidecar_config=config, sim_args=sim_args, profile=profile, **settings)


def start_stack(
    config: dict[str, Any] | None = None,
    sim_args: Sequence[str] = (),
    profile: str = "inline",
    **options: Unpack[StackOptions],
) -> LocalStack:
    """`build_stack(...)`, started: the caller stops it."""
    stack = build_stack(config, sim_args, profile, **options)
    stack.start()
    return stack


def profile_stack(
    make_stack: Any, profile: str, config: dict[str, Any], sim_args: list[str]
) -> Iterator[Stack]:
    """A module's stack in one profile, stopped when the module moves on to the other."""
    stack: Stack = make_stack(config, sim_args, profile)
    yield stack
    stack.stack.stop()


def end_reports_to(port: int, cluster: str) -> Callable[[dict[str, Any]], None]:
    """An Envoy patch (with the tests' tenant-header trust): the lean profile's end-report logger talks to
    `port` through a copy of the sidecar's cluster named `cluster`; ext_proc keeps the sidecar's own."""

    def patch(config: dict[str, Any]) -> None:
        trust_client_tenant_header(config)
        clusters = config["static_resources"]["clusters"]
        sidecar = next(c for c in clusters if c["name"] == EXTPROC_CLUSTER)
        copy = json.loads(json.dumps(sidecar))
        copy["name"] = copy["load_assignment"]["cluster_name"] = cluster
        for group in copy["load_assignment"]["endpoints"]:
            for endpoint in group["lb_endpoints"]:
                endpoint["endpoint"]["address"]["socket_address"]["port_value"] = port
        clusters.append(copy)
        for hcm in http_connection_managers(config):
            for logger in hcm["access_log"]:
                if logger["name"] == "envoy.access_loggers.http_grpc":
                    service = logger["typed_config"]["common_config"]["grpc_service"]
                    service["envoy_grpc"]["cluster_name"] = cluster

    return patch


def dead_end_reports(port: int) -> Callable[[dict[str, Any]], None]:
    """An Envoy patch: the end-report logger talks to `port`, where nothing listens; ext_proc is intact."""
    return end_reports_to(port, "end_report_nowhere")


def streamed_usage(url: str, model: str, max_tokens: int, extra_body: dict[str, Any]) -> int | None:
    """One streamed chat completion through the gateway at `url`, read to its end with the `openai` SDK (no
    retries), `extra_body` added to it: the completion tokens its usage reports (None: no usage came)."""
    usage = None
    with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as client:
        stream = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Tell me a long story."}],
            max_tokens=max_tokens,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=extra_body,
        )
        for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage.completion_tokens
    return usage


def stream_chat(url: str, model: str, max_tokens: int, answer: int, out: list[int]) -> None:
    """`streamed_usage` with the simulator answering `answer` tokens under a reservation of `max_tokens`; its
    reported completion tokens appended to `out`."""
    usage = streamed_usage(url, model, max_tokens, {"sim_output_tokens": answer})
    if usage is not None:
        out.append(usage)
