"""A no-op ext_proc processor: grpc.aio, CONTINUE to every message, nothing parsed or counted.

It is the floor the sidecar is compared with: same language, same gRPC stack, same processing mode as
envoy/envoy.yaml (request headers, BUFFERED request body, response headers, STREAMED response body), so the
difference between the two is the admission logic itself, not Python gRPC's per-stream cost.
`python -m bench.overhead.noop_processor --port N`.

With `--lean` it is the floor of the lean profile: it answers the request body with the same dynamic
metadata the sidecar writes for a chat request (a report key, the reading spec, the x-ratelimit-* values),
so Envoy's Lua reader and access log do the same work, and drains the access-log entries unread.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
from collections.abc import AsyncIterator
from typing import Any

import grpc
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from extproc.admission.tracking.reading import OPENAI_SPEC
from extproc.admission.vocabulary.names import NAMESPACE, RATELIMIT_HEADERS, REPORT_KEY

_HEADERS = pb.HeadersResponse()
_BODY = pb.BodyResponse()
REPLIES = {
    "request_headers": pb.ProcessingResponse(request_headers=_HEADERS),
    "request_body": pb.ProcessingResponse(request_body=_BODY),
    "response_headers": pb.ProcessingResponse(response_headers=_HEADERS),
    "response_body": pb.ProcessingResponse(response_body=_BODY),
    "request_trailers": pb.ProcessingResponse(request_trailers=pb.TrailersResponse()),
    "response_trailers": pb.ProcessingResponse(response_trailers=pb.TrailersResponse()),
}


class NoopProcessor(pb_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    def __init__(self, lean: bool = False) -> None:
        self.lean = lean
        self.keys = itertools.count()

    async def Process(
        self, request_iterator: AsyncIterator[pb.ProcessingRequest], context: Any
    ) -> AsyncIterator[pb.ProcessingResponse]:
        async for message in request_iterator:
            kind = message.WhichOneof("request")
            if self.lean and kind == "request_body":
                yield self.admitted()
                continue
            reply = REPLIES.get(kind)
            if reply is not None:
                yield reply

    def admitted(self) -> pb.ProcessingResponse:
        """The body reply with the metadata the sidecar writes for an admitted chat request."""
        reply = pb.ProcessingResponse(request_body=_BODY)
        fields = reply.dynamic_metadata.fields[NAMESPACE].struct_value.fields
        fields[REPORT_KEY].string_value = f"noop-{next(self.keys)}"
        fields["read"].struct_value.update(OPENAI_SPEC.to_struct(strip=True))
        for name in RATELIMIT_HEADERS:
            fields[name].string_value = "1"
        return reply


class DrainReports(als_pb2_grpc.AccessLogServiceServicer):  # type: ignore[misc]
    """Reads every access-log entry and does nothing with it."""

    async def StreamAccessLogs(self, request_iterator: AsyncIterator[Any], context: Any) -> Any:
        async for _message in request_iterator:
            pass
        return als_pb2.StreamAccessLogsResponse()


async def serve(port: int, lean: bool = False) -> None:
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", 16 << 20)])
    pb_grpc.add_ExternalProcessorServicer_to_server(NoopProcessor(lean), server)
    als_pb2_grpc.add_AccessLogServiceServicer_to_server(DrainReports(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print(f"noop processor listening on 127.0.0.1:{port}", flush=True)
    await server.wait_for_termination()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--lean", action="store_true", help="answer as the lean profile's sidecar does")
    args = parser.parse_args()
    asyncio.run(serve(args.port, args.lean))


if __name__ == "__main__":
    main()
