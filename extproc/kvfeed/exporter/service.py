"""gRPC side of the exporter: the KvFeed.Watch stream over the sample hub."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import grpc

from extproc.kvfeed.exporter.hub import SampleHub
from extproc.kvfeed.exporter.metrics import ExporterMetrics
from extproc.kvfeed.proto import feedback_pb2, feedback_pb2_grpc
from extproc.kvfeed.sample import to_proto

log = logging.getLogger(__name__)


class KvFeedService(feedback_pb2_grpc.KvFeedServicer):
    """Each Watch gets the newest sample per endpoint at once, then every newer one (coalesced when the
    client reads slowly: HTTP/2 flow control blocks our `yield`, the hub keeps only the newest)."""

    def __init__(self, hub: SampleHub, metrics: ExporterMetrics) -> None:
        self._hub = hub
        self._metrics = metrics

    async def Watch(
        self, request: feedback_pb2.WatchRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[feedback_pb2.KvSample]:
        # Read once, here: after a client cancels, the call under `context` may be gone, and `peer()` in the
        # `finally` below then crashed the process with SIGSEGV (grpcio 1.85;
        # tests/component/kvfeed/test_exporter_process.py).
        peer = context.peer()
        sub = self._hub.subscribe(request.models)
        self._metrics.subscribers.set(self._hub.subscribers)
        log.info("subscriber connected", extra={"peer": peer, "models": list(request.models)})
        try:
            while not sub.closed:
                for sample in await sub.next_batch():
                    yield to_proto(sample)
        finally:
            sub.close()
            self._metrics.subscribers.set(self._hub.subscribers)
            log.info("subscriber left", extra={"peer": peer})
