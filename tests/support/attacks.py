"""What the attack suites check after each try: requests that reached the backend, tokens reserved, and a
ledger that balances with no lease left open."""

from __future__ import annotations

import time
from typing import Any

from tests.support.stack import Stack, http

MODEL = "llama-3-8b"


def envoy_stat(stack: Stack, name: str) -> float:
    """A counter of Envoy's own (admin /stats), e.g. how many requests reached the upstream cluster."""
    text = http(
        "GET", f"http://127.0.0.1:{stack.stack.ports.envoy_admin}/stats?filter=^{name}$"
    ).body.decode()
    for line in text.splitlines():
        key, _, value = line.partition(": ")
        if key == name:
            return float(value)
    return 0.0


def upstream_requests(stack: Stack) -> float:
    return envoy_stat(stack, "cluster.llm_upstream.upstream_rq_total")


def reserved(stack: Stack) -> float:
    return stack.sidecar("extproc_tokens_reserved_total")


def wait_idle(stack: Stack, limit_s: float = 10.0) -> None:
    deadline = time.monotonic() + limit_s
    while stack.sidecar("extproc_active_requests") != 0:
        assert time.monotonic() < deadline, "leases still open"
        time.sleep(0.02)


def assert_nothing_leaked(stack: Stack) -> None:
    wait_idle(stack)
    reserve, refunded = reserved(stack), stack.sidecar("extproc_tokens_refunded_total")
    overrun, settled = (
        stack.sidecar("extproc_tokens_overrun_total"),
        stack.sidecar("extproc_tokens_settled_total"),
    )
    assert reserve - refunded + overrun == settled


def chat(content: Any, **fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **fields}


def post(stack: Stack, path: str, body: Any, **headers: str) -> Any:
    return http("POST", stack.url + path, body, headers=headers)
