"""A no-op ext_proc processor: grpc.aio, CONTINUE to every message, nothing parsed or counted.

It is the floor the sidecar is compared with: same language, same gRPC stack, same processing mode as
envoy/envoy.yaml (request headers, BUFFERED request body, response headers, STREAMED response body), so the
difference between the two is the admission logic itself, not Python gRPC's per-stream cost.
`python -m bench.overhead.noop_processor --port N`.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

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
    async def Process(
        self, request_iterator: AsyncIterator[pb.ProcessingRequest], context: Any
    ) -> AsyncIterator[pb.ProcessingResponse]:
        async for message in request_iterator:
            reply = REPLIES.get(message.WhichOneof("request"))
            if reply is not None:
                yield reply


async def serve(port: int) -> None:
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", 16 << 20)])
    pb_grpc.add_ExternalProcessorServicer_to_server(NoopProcessor(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print(f"noop processor listening on 127.0.0.1:{port}", flush=True)
    await server.wait_for_termination()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    asyncio.run(serve(parser.parse_args().port))


if __name__ == "__main__":
    main()
