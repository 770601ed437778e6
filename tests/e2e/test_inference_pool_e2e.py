"""The sidecar as the first ext_proc in front of an inference pool's endpoint picker (docs/gateways.md).

A stand-in picker (tests/support/picker.py) runs as the second ext_proc filter of a real Envoy, as the
Gateway API Inference Extension's endpoint picker (EPP) does: it names the endpoint it picked in
`x-gateway-destination-endpoint`, which Envoy's upstream cluster routes to, or refuses with 429 or 503.

In both profiles: the picker sees only requests the sidecar admitted; a refused request refunds its whole
reservation (the engine never saw it) and releases its slot at once; a picked one settles as usual.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import openai
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc

from devstack.processes import free_port
from tests.support.ledger import Ledger, wait_settled
from tests.support.picker import VERDICT, StandInPicker, behind_the_picker
from tests.support.stack import Stack, build_stack, fixed_step_sim, http

pytestmark = pytest.mark.e2e

MODEL = "llama-3-8b"
MESSAGES: Any = [{"role": "user", "content": "Pick a server for me."}]
CONFIG = {
    "models": {"*": {"context_window": 4096, "default_max_tokens": 64}},
    # One slot: a refused request that kept it would refuse the next one.
    "limits": {"models": {MODEL: {"max_concurrency": 1}}},
}


class Pool:
    def __init__(self, stack: Stack, picker: StandInPicker) -> None:
        self.stack = stack
        self.picker = picker


@pytest.fixture(scope="module")
def picker() -> Iterator[tuple[StandInPicker, int]]:
    port = free_port()
    server = grpc.server(ThreadPoolExecutor(max_workers=8))
    servicer = StandInPicker("")  # its endpoint is the simulator's, known once the stack exists
    external_processor_pb2_grpc.add_ExternalProcessorServicer_to_server(servicer, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    try:
        yield servicer, port
    finally:
        server.stop(0)


@pytest.fixture(scope="module")
def pool(profile: str, picker: tuple[StandInPicker, int]) -> Iterator[Pool]:
    servicer, port = picker
    local = build_stack(
        config=CONFIG,
        sim_args=fixed_step_sim(MODEL, 2),
        envoy_patch=behind_the_picker(port),
        profile=profile,
    )
    servicer.endpoint = f"127.0.0.1:{local.ports.upstream}"
    local.start()
    try:
        yield Pool(Stack(local), servicer)
    finally:
        local.stop()


def chat(url: str, verdict: str | None = None, max_tokens: int = 16) -> Any:
    headers = {VERDICT: verdict} if verdict else {}
    return http(
        "POST",
        f"{url}/v1/chat/completions",
        {"model": MODEL, "messages": MESSAGES, "max_tokens": max_tokens},
        headers,
    )


def test_a_picked_request_reaches_the_picked_endpoint_and_settles_as_usual(pool: Pool) -> None:
    stack = pool.stack
    before = Ledger.read(stack)
    reply = chat(stack.url)
    assert reply.status == 200, reply.body
    usage = reply.json()["usage"]
    assert wait_settled(stack)
    delta = Ledger.read(stack) - before
    assert delta.prompt == usage["prompt_tokens"] and delta.completion == usage["completion_tokens"]
    assert delta.refunded == delta.reserved - (delta.prompt + delta.completion)
    assert delta.sim_prompt == usage["prompt_tokens"]


@pytest.mark.parametrize("status", [429, 503])
def test_a_refused_request_refunds_its_reservation_and_releases_its_slot(pool: Pool, status: int) -> None:
    stack = pool.stack
    before = Ledger.read(stack)
    reply = chat(stack.url, str(status))
    assert reply.status == status, reply.body
    assert wait_settled(stack), "the refused request still holds its slot"
    delta = Ledger.read(stack) - before
    assert delta.reserved > 0, "the sidecar admitted it before the picker refused it"
    assert delta.refunded == delta.reserved, "the engine never saw it: nothing may be charged"
    assert delta.prompt == 0 and delta.completion == 0
    assert delta.sim_prompt == 0
    # The one slot is free again: the next request is admitted and picked.
    assert chat(stack.url).status == 200


def test_the_picker_sees_only_what_the_sidecar_admitted(pool: Pool) -> None:
    """First the sidecar, then the picker: a request the sidecar refuses never costs the picker a call."""
    stack = pool.stack
    assert wait_settled(stack)  # the one slot is free (lean: the last request's end report has come)
    seen = len(pool.picker.seen)
    refused = http(
        "POST",
        f"{stack.url}/v1/chat/completions",
        {"model": MODEL, "messages": "not a list", "max_tokens": 4},
    )
    assert refused.status == 400
    assert len(pool.picker.seen) == seen
    assert chat(stack.url).status == 200
    assert len(pool.picker.seen) == seen + 1


def test_streamed_answers_through_the_picker_settle_exactly(pool: Pool) -> None:
    stack = pool.stack
    before = Ledger.read(stack)
    with openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0) as client:
        chunks = list(
            client.chat.completions.create(
                model=MODEL,
                messages=MESSAGES,
                max_tokens=12,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
    usage = chunks[-1].usage
    assert usage is not None
    assert wait_settled(stack)
    delta = Ledger.read(stack) - before
    assert delta.completion == usage.completion_tokens
    assert delta.refunded == delta.reserved - (delta.prompt + delta.completion)
