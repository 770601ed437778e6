"""A stand-in for an inference pool's endpoint picker (EPP), for the tests that run one in a real Envoy.

It runs as an ext_proc filter, as the Gateway API Inference Extension's picker does: on the request headers
it sets `x-gateway-destination-endpoint` to the endpoint it picked
(docs/proposals/004-endpoint-picker-protocol of kubernetes-sigs/gateway-api-inference-extension v1.6.0), and
Envoy's upstream cluster routes to the address in that header (an ORIGINAL_DST cluster with `use_http_header`,
as kgateway builds the pool's cluster). Or it refuses, with the protocol's ImmediateResponse statuses: 429
(shed) or 503 (no ready endpoint).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from typing import Any

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc
from envoy.type.v3 import http_status_pb2

from tests.support.stack import add_grpc_cluster

DESTINATION = "x-gateway-destination-endpoint"
VERDICT = "x-test-picker"  # what the stand-in picker does with this request: pick (absent), 429 or 503
PICKER_FILTER = "inference_pool.endpoint_picker"


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
        add_grpc_cluster(config, "endpoint_picker", picker_port)
        clusters = config["static_resources"]["clusters"]
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
