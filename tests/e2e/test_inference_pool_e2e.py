"""The sidecar as the first ext_proc in front of an inference pool's endpoint picker (docs/gateways.md).

A stand-in picker, a small ext_proc server in this test, runs as the second ext_proc filter of a real Envoy,
as the Gateway API Inference Extension's endpoint picker (EPP) does: on the request headers it sets
`x-gateway-destination-endpoint` to the endpoint it picked (docs/proposals/004-endpoint-picker-protocol of
kubernetes-sigs/gateway-api-inference-extension v1.6.0), and Envoy's upstream cluster routes to the address
in that header (an ORIGINAL_DST cluster with `use_http_header`, as kgateway builds the pool's cluster). Or
it refuses, with the protocol's ImmediateResponse statuses: 429 (shed) or 503 (no ready endpoint).

In both profiles: the picker sees only requests the sidecar admitted; a refused request refunds its whole
reservation (the engine never saw it) and releases its slot at once; a picked one settles as usual.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import openai
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc
from envoy.type.v3 import http_status_pb2

from devstack.processes import free_port
from tests.support.ledger import Ledger, wait_settled
from tests.support.stack import Stack, build_stack, fixed_step_sim, http

pytestmark = pytest.mark.e2e

MODEL = "llama-3-8b"
MESSAGES: Any = [{"role": "user", "content": "Pick a server for me."}]
DESTINATION = "x-gateway-destination-endpoint"
VERDICT = "x-test-picker"  # what the stand-in picker does with this request: pick (absent), 429 or 503
PICKER_FILTER = "inference_pool.endpoint_picker"
CONFIG = {
    "models": {"*": {"context_window": 4096, "default_max_tokens": 64}},
    # One slot: a refused request that kept it would refuse the next one.
    "limits": {"models": {MODEL: {"max_concurrency": 1}}},
}


class StandInPicker(external_processor_pb2_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    """Picks the one simulator for every request, or refuses as the header VERDICT says."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.seen: list[str] = []
        self.lock = threading.Lock()

    def Process(
        self, request_iterator: Iterable[pb.ProcessingRequest], context: grpc.ServicerContext
    ) -> Iterator[pb.ProcessingResponse]:
        for request in request_iterator:
            if not request.HasField("request_headers"):
                continue
            headers = {h.key: h.raw_value.decode() for h in request.request_headers.headers.headers}
            verdict = headers.get(VERDICT, "pick")
            with self.lock:
                self.seen.append(verdict)
            yield refusal(int(verdict)) if verdict != "pick" else self.pick()

    def pick(self) -> pb.ProcessingResponse:
        header = base_pb2.HeaderValue(key=DESTINATION, raw_value=self.endpoint.encode())
        mutation = pb.HeaderMutation(set_headers=[base_pb2.HeaderValueOption(header=header)])
        return pb.ProcessingResponse(
            request_headers=pb.HeadersResponse(response=pb.CommonResponse(header_mutation=mutation))
        )


def refusal(status: int) -> pb.ProcessingResponse:
    body = b'{"error":{"message":"no endpoint","type":"server_error","param":null,"code":null}}'
    return pb.ProcessingResponse(
        immediate_response=pb.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=status), body=body, details=f"picker_{status}"
        )
    )


def behind_the_picker(picker_port: int) -> Any:
    """An Envoy patch: the picker as a second ext_proc filter just before the router, and the upstream
    cluster routing to the endpoint the picker named."""

    def patch(config: dict[str, Any]) -> None:
        clusters = config["static_resources"]["clusters"]
        sidecar = next(c for c in clusters if c["name"] == "llm_admission_extproc")
        picker = copy.deepcopy(sidecar)
        picker["name"] = picker["load_assignment"]["cluster_name"] = "endpoint_picker"
        address = picker["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]
        address["socket_address"]["port_value"] = picker_port
        clusters.append(picker)
        upstream = next(c for c in clusters if c["name"] == "llm_upstream")
        upstream.pop("load_assignment")
        upstream["type"] = "ORIGINAL_DST"
        upstream["lb_policy"] = "CLUSTER_PROVIDED"
        upstream["original_dst_lb_config"] = {"use_http_header": True, "http_header_name": DESTINATION}
        for listener in config["static_resources"]["listeners"]:
            hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
            filters = hcm["http_filters"]
            router = next(i for i, f in enumerate(filters) if f["name"] == "envoy.filters.http.router")
            filters.insert(router, picker_filter())

    return patch


def picker_filter() -> dict[str, Any]:
    """The EPP's filter as the inference gateways configure it for the request path: headers sent, fail
    closed. (The real EPP also reads the body and the response; the stand-in needs neither.)"""
    return {
        "name": PICKER_FILTER,
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
            "grpc_service": {"envoy_grpc": {"cluster_name": "endpoint_picker"}},
            "failure_mode_allow": False,
            "message_timeout": "1s",
            "processing_mode": {
                "request_header_mode": "SEND",
                "request_body_mode": "NONE",
                "response_header_mode": "SKIP",
                "response_body_mode": "NONE",
                "request_trailer_mode": "SKIP",
                "response_trailer_mode": "SKIP",
            },
        },
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
