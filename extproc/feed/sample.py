"""The in-process form of one feed sample, and its conversion to and from the KvFeed protobuf.

Components pass `FeedSample` (a frozen dataclass with plain Python types) and convert at the gRPC edge
only, so the parser, hub, aggregation and tests never depend on generated code.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from extproc.feed.engines import ServerKind
from extproc.feed.parse import ModelSignals
from extproc.feed.proto import feedback_pb2

SampleKey = tuple[str, str, str]  # (node, endpoint, model)

_KIND_TO_PB: dict[ServerKind, int] = {
    ServerKind.VLLM: feedback_pb2.SERVER_KIND_VLLM,
    ServerKind.SGLANG: feedback_pb2.SERVER_KIND_SGLANG,
    ServerKind.TGI: feedback_pb2.SERVER_KIND_TGI,
    ServerKind.TRTLLM: feedback_pb2.SERVER_KIND_TRTLLM,
    ServerKind.TRITON: feedback_pb2.SERVER_KIND_TRITON,
}
_PB_TO_KIND: dict[int, ServerKind] = {v: k for k, v in _KIND_TO_PB.items()}


@dataclass(frozen=True, slots=True)
class FeedSample:
    """One scrape of one model on one endpoint. `sample_time` is the exporter's wall clock (unix s)."""

    node: str
    endpoint: str
    model: str
    server_kind: ServerKind | None
    kv_usage: float | None
    requests_waiting: float | None
    requests_running: float | None
    preemptions_total: float | None
    kv_capacity_tokens: int | None
    sample_time: float
    up: bool
    error: str = ""
    scrape_duration_seconds: float = 0.0

    @property
    def key(self) -> SampleKey:
        return (self.node, self.endpoint, self.model)

    @classmethod
    def from_signals(
        cls, node: str, endpoint: str, signals: ModelSignals, sample_time: float, duration: float
    ) -> FeedSample:
        return cls(
            node=node,
            endpoint=endpoint,
            model=signals.model,
            server_kind=signals.kind,
            kv_usage=signals.kv_usage,
            requests_waiting=signals.requests_waiting,
            requests_running=signals.requests_running,
            preemptions_total=signals.preemptions_total,
            kv_capacity_tokens=signals.kv_capacity_tokens,
            sample_time=sample_time,
            up=True,
            scrape_duration_seconds=duration,
        )

    @classmethod
    def down(
        cls,
        node: str,
        endpoint: str,
        model: str,
        kind: ServerKind | None,
        error: str,
        sample_time: float,
        duration: float = 0.0,
    ) -> FeedSample:
        """A failed scrape: sent like any sample so subscribers stop trusting the endpoint at once."""
        return cls(
            node=node,
            endpoint=endpoint,
            model=model,
            server_kind=kind,
            kv_usage=None,
            requests_waiting=None,
            requests_running=None,
            preemptions_total=None,
            kv_capacity_tokens=None,
            sample_time=sample_time,
            up=False,
            error=error,
            scrape_duration_seconds=duration,
        )


def to_proto(sample: FeedSample) -> feedback_pb2.KvSample:
    msg = feedback_pb2.KvSample(
        node=sample.node,
        endpoint=sample.endpoint,
        model=sample.model,
        server_kind=_KIND_TO_PB.get(sample.server_kind, 0) if sample.server_kind else 0,  # type: ignore[arg-type]
        kv_capacity_tokens=max(0, sample.kv_capacity_tokens or 0),
        up=sample.up,
        error=sample.error,
        scrape_duration_seconds=sample.scrape_duration_seconds,
    )
    for field in ("kv_usage", "requests_waiting", "requests_running", "preemptions_total"):
        value = getattr(sample, field)
        if value is not None and not math.isnan(value):
            setattr(msg, field, value)
    seconds = math.floor(sample.sample_time)
    msg.sample_time.seconds = seconds
    msg.sample_time.nanos = min(999_999_999, int((sample.sample_time - seconds) * 1e9))
    return msg


def from_proto(msg: feedback_pb2.KvSample) -> FeedSample:
    def opt(field: str) -> float | None:
        return float(getattr(msg, field)) if msg.HasField(field) else None

    return FeedSample(
        node=msg.node,
        endpoint=msg.endpoint,
        model=msg.model,
        server_kind=_PB_TO_KIND.get(msg.server_kind),
        kv_usage=opt("kv_usage"),
        requests_waiting=opt("requests_waiting"),
        requests_running=opt("requests_running"),
        preemptions_total=opt("preemptions_total"),
        kv_capacity_tokens=int(msg.kv_capacity_tokens) or None,
        sample_time=msg.sample_time.seconds + msg.sample_time.nanos / 1e9,
        up=msg.up,
        error=msg.error,
        scrape_duration_seconds=msg.scrape_duration_seconds,
    )
