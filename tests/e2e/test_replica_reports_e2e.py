"""The lean profile with the sidecar behind a Service (Envoy Gateway, docs/gateways.md): the access-log entry
that ends a request reaches another replica than the one that admitted it, and the lease is still settled
exactly and at once.

Two sidecar replicas share one real Redis; one real Envoy (lean profile) sends its ext_proc streams to
replica A and its gRPC access log to replica B, the worst case of the two separately balanced connections.
The access logger is the one Envoy Gateway builds from k8s/envoy-gateway/lean/envoyproxy.yaml: its CEL match,
its log name, Envoy's default flush interval.
B relays each entry to A through Redis (extproc/protocol/relay.py). Without the relay the lease would wait for
`end_report_wait_seconds` (60 s here) and then be charged an estimate: the test's one slot would stay taken.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from typing import Any

import openai
import pytest
import yaml

from devstack.processes import Ports, Process, wait_http
from devstack.stack import LocalStack, sidecar_config_with_ports
from extproc.envoyconf.profiles import REPO
from tests.component.store.redis_server import RedisServer
from tests.support.stack import Stack, add_grpc_cluster, build_stack, fixed_step_sim, http, metric

pytestmark = pytest.mark.e2e

MODEL = "llama-3-8b"
MESSAGES: Any = [{"role": "user", "content": "Tell me a story."}]
SETTLE_WITHIN_S = 5.0


def sidecar_config(redis_url: str) -> dict[str, Any]:
    return {
        # Far longer than the test: a lease settled here was settled by a report, not by expiry.
        "admission": {"end_report_wait_seconds": 60},
        "models": {"*": {"context_window": 4096, "default_max_tokens": 64}},
        "limits": {"models": {MODEL: {"max_concurrency": 1}}},
        "store": {"backend": "redis", "on_unavailable": "reject", "redis": {"url": redis_url}},
    }


ENVOY_PROXY = REPO / "k8s" / "envoy-gateway" / "lean" / "envoyproxy.yaml"


def shipped_sink() -> tuple[str, str]:
    """The CEL match and log name of the shipped EnvoyProxy's ALS sink."""
    setting = yaml.safe_load(ENVOY_PROXY.read_text())["spec"]["telemetry"]["accessLog"]["settings"][0]
    (expression,) = setting["matches"]
    return expression, setting["sinks"][0]["als"]["logName"]


CEL_FILTER = "type.googleapis.com/envoy.extensions.access_loggers.filters.cel.v3.ExpressionFilter"


def as_envoy_gateway_builds_it(logger: dict[str, Any]) -> None:
    """The access logger as Envoy Gateway v1.9.0 builds it from envoyproxy.yaml (internal/xds/translator/
    accesslog.go): the `matches` CEL expression as its filter, the sink's log name, and no
    buffer_flush_interval (Envoy's 1 s default)."""
    expression, log_name = shipped_sink()
    logger["filter"] = {
        "extension_filter": {
            "name": "envoy.access_loggers.extension_filters.cel",
            "typed_config": {
                "@type": CEL_FILTER,
                "expression": expression,
            },
        }
    }
    common = logger["typed_config"]["common_config"]
    common["log_name"] = log_name
    common.pop("buffer_flush_interval", None)


def access_log_to(port: int) -> Any:
    """An Envoy patch: the gRPC access logger, as Envoy Gateway builds it, reports to a cluster of its own,
    the sidecar on `port`."""

    def patch(config: dict[str, Any]) -> None:
        add_grpc_cluster(config, "llm_admission_reports", port)
        loggers = 0
        for listener in config["static_resources"]["listeners"]:
            hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
            for logger in hcm.get("access_log", []):
                if logger["name"] == "envoy.access_loggers.http_grpc":
                    service = logger["typed_config"]["common_config"]["grpc_service"]
                    service["envoy_grpc"]["cluster_name"] = "llm_admission_reports"
                    as_envoy_gateway_builds_it(logger)
                    loggers += 1
        assert loggers == 1, "the lean config has one gRPC access logger"

    return patch


class Replicas:
    """The stack (Envoy, simulator, replica A) and replica B, each sidecar's metrics by name."""

    def __init__(self, stack: LocalStack, b_admin: str) -> None:
        self.stack = Stack(stack)
        self.a_admin = f"{stack.admin_url}/metrics"
        self.b_admin = f"{b_admin}/metrics"

    def a(self, name: str, **labels: str) -> float:
        return metric(self.a_admin, name, **labels)

    def b(self, name: str, **labels: str) -> float:
        return metric(self.b_admin, name, **labels)


@pytest.fixture(scope="module")
def replicas() -> Iterator[Replicas]:
    redis = RedisServer()
    redis.start()
    config = sidecar_config(redis.url)
    b_ports = Ports.free()
    stack = build_stack(
        config=config,
        sim_args=fixed_step_sim(MODEL, 5),
        envoy_patch=access_log_to(b_ports.grpc),
        profile="lean",
    )
    b: Process | None = None
    try:
        stack.start()
        assert stack.workdir is not None
        b_config = stack.workdir / "sidecar-b.yaml"
        b_config.write_text(yaml.safe_dump(sidecar_config_with_ports(config, b_ports)))
        b = Process.start(
            "sidecar-b", [sys.executable, "-m", "extproc", "serve", "--config", str(b_config)], stack.workdir
        )
        wait_http(f"http://127.0.0.1:{b_ports.admin}/readyz", proc=b)
        yield Replicas(stack, f"http://127.0.0.1:{b_ports.admin}")
    finally:
        if b is not None:
            b.stop()
        stack.stop()
        redis.stop()


def stream_one(url: str, max_tokens: int) -> tuple[str, Any]:
    with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as client:
        chunks = list(
            client.chat.completions.create(
                model=MODEL,
                messages=MESSAGES,
                max_tokens=max_tokens,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks[-1].usage


def wait_for(condition: Any, limit_s: float) -> bool:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return False


def test_a_lease_is_settled_exactly_by_the_report_another_replica_received(replicas: Replicas) -> None:
    reserved = replicas.a("extproc_tokens_reserved_total")
    refunded = replicas.a("extproc_tokens_refunded_total")
    text, usage = stream_one(replicas.stack.url, 20)
    assert text and usage is not None
    assert wait_for(lambda: replicas.a("extproc_active_requests") == 0, SETTLE_WITHIN_S), (
        "replica A still holds the lease: the report that reached B never came back to it"
    )
    assert replicas.b("extproc_end_reports_total", result="relayed") >= 1
    assert replicas.a("extproc_end_reports_total", result="matched") >= 1
    assert replicas.a("extproc_end_reports_total", result="unknown") == 0
    assert replicas.a("extproc_settlements_total", outcome="expired") == 0
    # Settled with what the answer used, as if the report had come to A directly.
    settled = usage.prompt_tokens + usage.completion_tokens
    delta_reserved = replicas.a("extproc_tokens_reserved_total") - reserved
    assert replicas.a("extproc_tokens_refunded_total") - refunded == delta_reserved - settled


def test_the_shared_slot_is_free_for_the_next_request_at_once(replicas: Replicas) -> None:
    """One slot across both replicas: each request finds it free again only because the one before was
    settled by its relayed report, not 60 s later by expiry."""
    for _ in range(3):
        text, _ = stream_one(replicas.stack.url, 8)
        assert text
        assert wait_for(lambda: replicas.a("extproc_active_requests") == 0, SETTLE_WITHIN_S)
    refused = http(
        "POST",
        f"{replicas.stack.url}/v1/chat/completions",
        {"model": MODEL, "messages": MESSAGES, "max_tokens": 4},
    )
    assert refused.status == 200, refused.body
