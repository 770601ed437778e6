"""Gateway stacks in front of the tier's one engine, and the counters both sides keep.

A stack is Envoy + the sidecar (+ the exporter when asked) with `start_stack(with_simulator=False)` and its
upstream port set to the engine's, so the same engine serves both profiles and the direct baseline.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from devstack.envoy import trust_client_tenant_header
from devstack.processes import Ports
from devstack.stack import LocalStack
from extproc.envoyconf.bootstrap import http_connection_managers
from tests.support import prefix_load
from tests.support.engine import CACHE_TOKENS, MAX_MODEL_LEN, MODEL, Engine
from tests.support.stack import Stack, http, start_stack
from tests.support.waiting import wait_for

LLAMA3_TEMPLATE = {"per_message": 4, "per_request": 5, "bos": 1}
"""Llama-3's template costs as measured on this engine (docs/configuration.md, template costs): a message is
`<|start_header_id|>`, the role, `<|end_header_id|>`, a blank line, the text and `<|eot_id|>` (the sidecar
tokenizes the role with the text, so 4 remain); a request adds `<|begin_of_text|>` and the assistant header
(4); a completions prompt gets `<|begin_of_text|>`."""


def engine_config(**limits: Any) -> dict[str, Any]:
    """A sidecar config for the tiny engine: its window, Llama-3's template costs, generous limits."""
    return {
        # The tier compares admission's exact prompt count with vLLM's: bound admission (the shipped default,
        # tests/e2e/test_bound_e2e.py) would reserve the byte bound first and correct it after the verdict.
        "admission": {
            "max_body_bytes": 1_048_576,
            "tenant": {"header": "x-tenant"},
            "bound_admission": False,
        },
        "models": {
            "*": {"context_window": MAX_MODEL_LEN, "default_max_tokens": 256, "template": LLAMA3_TEMPLATE}
        },
        "limits": {
            "global": {"tokens_per_minute": 100_000_000},
            "models": {MODEL: {"max_concurrency": 64}},
            **limits,
        },
    }


def prefix_config(sharing: bool = True) -> dict[str, Any]:
    """The shipped protection (bound admission, forecast booking, prefix sharing) with slots out of the way:
    only the KV budget decides."""
    config = engine_config()
    config["admission"]["bound_admission"] = True
    config["limits"]["models"] = {MODEL: {"max_concurrency": 128}}
    config["kv_budget"] = {"enabled": True, "target_utilization": 0.9, "prefix_sharing": sharing}
    return config


def warm_up(gateway: Stack) -> None:
    """Until the feed reports the engine, then one short stream: a pool in service has a decode pace learned
    from finished streams (the forecast and the refusals' retry-after use it), and the engine has the system
    prompt in its cache for both runs alike."""
    deadline = time.monotonic() + 60
    while gateway.sidecar("extproc_kv_capacity_tokens") != CACHE_TOKENS:
        assert time.monotonic() < deadline, "the KV feed never reported the engine's capacity"
        time.sleep(0.2)
    warm = prefix_load.chat_body(MODEL, -1, output_tokens=32)
    assert http("POST", f"{gateway.url}/v1/chat/completions", warm).status == 200
    wait_idle(gateway)


def overload_through(engine: Engine, gateway: Stack, requests: int = prefix_load.REQUESTS) -> prefix_load.Run:
    """The shared-prefix overload through `gateway`, its booking sampled beside the engine's KV, from an idle
    engine that the sidecar has read idle (`wait_read_idle`)."""
    return prefix_load.overload(
        MODEL,
        engine.url,
        gateway.url,
        CACHE_TOKENS,
        admin_url=gateway.stack.admin_url,
        settle=lambda: wait_read_idle(gateway),
        requests=requests,
    )


ENGINE_HOST_MESSAGE_TIMEOUT = "15s"
"""The ext_proc message timeout on the engine tier's Envoy. vLLM's CPU backend binds its compute threads to
one core and reserves the other for its scheduler process (utils/ompmultiprocessing.py, vLLM 0.32.0: "at
least reserve 1/local_world_size core for scheduler proc"), which leaves the sidecar and Envoy of this
two-core test host no core of their own while the engine decodes, and the CPU engine freezes the whole
host for seconds while it decodes (measured straight to vLLM, no gateway: response headers after up to
5.7 s, chunk gaps of up to 8.8 s, and an unrelated process's 50 ms sleep loop waking up to 7.3 s late;
bench/RESULTS.md section 5). On the tier (inline profile) a 4,000-token stream's response reached the client
6-12 s after the engine started answering, all held chunks at once, and at 5 s a request once timed out
(504). What the tier checks (settlement against vLLM's
counters, the path table, the feed, protection) does not depend on that timeout; it stays under the
configs' `max_message_timeout` (30 s), and tests/e2e/test_edge_e2e.py covers the shipped 5 s."""


def engine_host_envoy(config: dict[str, Any]) -> None:
    """The tests' tenant-header trust plus the engine host's longer ext_proc message timeout."""
    trust_client_tenant_header(config)
    for hcm in http_connection_managers(config):
        for http_filter in hcm["http_filters"]:
            typed = http_filter.get("typed_config", {})
            if "message_timeout" in typed:
                typed["message_timeout"] = ENGINE_HOST_MESSAGE_TIMEOUT


def start_gateway(
    engine: Engine,
    config: dict[str, Any],
    profile: str,
    with_exporter: bool = False,
    envoy_patch: Callable[[dict[str, Any]], None] = engine_host_envoy,
) -> LocalStack:
    ports = replace(Ports.free(), upstream=engine.port)
    stack = start_stack(
        ports=ports,
        config=config,
        with_simulator=False,
        with_exporter=with_exporter,
        # The CPU engine shares two cores with everything else: while it decodes, its /metrics page can take
        # several seconds (5 s timed out in CI), past the exporter's default 0.8 s scrape timeout.
        exporter_args=("--interval", "2", "--timeout", "15"),
        envoy_patch=envoy_patch,
        profile=profile,
        model=MODEL,
    )
    return stack


@dataclass
class Ledger:
    """The sidecar's token counters and the engine's own, to diff around a call."""

    reserved: float
    refunded: float
    overrun: float
    prompt: float
    completion: float
    engine_prompt: float
    engine_generated: float

    @classmethod
    def read(cls, stack: Stack) -> Ledger:
        wait_idle(stack)
        return cls(
            reserved=stack.sidecar("extproc_tokens_reserved_total"),
            refunded=stack.sidecar("extproc_tokens_refunded_total"),
            overrun=stack.sidecar("extproc_tokens_overrun_total"),
            prompt=stack.sidecar("extproc_tokens_settled_total", kind="prompt"),
            completion=stack.sidecar("extproc_tokens_settled_total", kind="completion"),
            engine_prompt=stack.upstream("vllm:prompt_tokens_total"),
            engine_generated=stack.upstream("vllm:generation_tokens_total"),
        )

    def __sub__(self, other: Ledger) -> Ledger:
        return Ledger(*(a - b for a, b in zip(vars(self).values(), vars(other).values(), strict=True)))

    @property
    def charged(self) -> float:
        """What the buckets kept: the booking, less refunds, plus what the usage exceeded it by."""
        return self.reserved - self.refunded + self.overrun


def wait_idle(stack: Stack, limit_s: float = 30.0) -> None:
    """Until the sidecar holds nothing and the engine runs nothing (an aborted request leaves the engine a
    step or two later than the client)."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        busy = (
            stack.sidecar("extproc_active_requests")
            + stack.upstream("vllm:num_requests_running")
            + stack.upstream("vllm:num_requests_waiting")
        )
        if busy == 0:
            return
        time.sleep(0.05)
    raise AssertionError(f"not idle after {limit_s}s")


def wait_read_idle(stack: Stack, limit_s: float = 30.0) -> None:
    """`wait_idle`, then until the sidecar's feed has read the engine's cache empty. A load run straight to
    the engine just before leaves the sidecar its last reading until the next (every 2 s on the tier, often
    seconds late on its saturated host): up to the whole cache in use that no lease of the sidecar explains,
    which it must keep counting (another gateway's or a direct client's), so a load through it that starts
    then starts behind somebody else's."""
    wait_idle(stack, limit_s)
    wait_for(
        lambda: stack.sidecar("extproc_kv_usage_ratio") <= 0.01, limit_s, "the feed reading the idle engine"
    )


def assert_settled_as_engine(delta: Ledger, prompt: int, completion: int) -> None:
    """The sidecar settled what the engine reported, and the engine's own counters agree."""
    assert (delta.prompt, delta.completion) == (prompt, completion)
    assert delta.charged == prompt + completion
    assert (delta.engine_prompt, delta.engine_generated) == (prompt, completion)
