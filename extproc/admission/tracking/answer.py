"""What the inline profile sees of the upstream's answer, message by message, as the in-flight request's
`Seen` (extproc/admission/tracking/inflight.py): the status, the usage the tracker follows, and when content
came."""

from __future__ import annotations

from dataclasses import dataclass

from extproc.admission.apis import dialect_for
from extproc.admission.capacity.admitted import Admitted
from extproc.admission.capacity.charging import ResponseFacts
from extproc.admission.tracking.inflight import Seen
from extproc.admission.tracking.usage_tracker import ResponseUsageTracker

PICKER_REFUSALS = frozenset({429, 503})
"""The statuses an inference pool's endpoint picker refuses with (ImmediateResponse 429: shed; 503: no ready
endpoint; gateway-api-inference-extension v1.6.0 docs/proposals/004-endpoint-picker-protocol). Inline, only
these, without the router's header, count as never forwarded: Envoy's router makes its own 502 and 504
without that header too, after the backend may have read the prompt, and they keep the backend-error rule.
Its own 503s say why by its response flags (the `response.flags` attribute): one made because it could not
connect to any engine (UF, UH) settles as the engine's outage (`engine_unreachable`); one made after the
engine's connection was reset or closed with the request sent (UR, UC: an engine stopping) keeps the
backend-error rule, as the lean profile's end report settles it (forwarded, no status from the engine).
Counted never forwarded, an engine's stop raised the alert meant for a picker's refusals
(`ExtprocRequestsNotForwarded`)."""


@dataclass(slots=True)
class Answer:
    """The upstream's answer so far, and when its first chunk came (for the pool's decode rate)."""

    status: int | None
    tracker: ResponseUsageTracker
    streaming: bool = False
    completed: bool = False
    first_chunk_at: float | None = None
    forwarded: bool = True
    engine_unreachable: bool = False  # the proxy answered: it could not connect to any engine
    engine_answered: bool = True  # False: the proxy answered after the engine's connection was reset
    passed_bytes: int = 0  # the body's bytes seen so far

    @classmethod
    def open(
        cls,
        admitted: Admitted,
        status: int | None,
        content_type: str,
        end_of_stream: bool,
        from_router: bool,
        engine_unreachable: bool = False,
        upstream_reset: bool = False,
    ) -> Answer:
        """Response headers arrived: choose how to read usage (SSE or JSON, removing the usage event the
        client did not ask for), and whether the request reached the backend at all (`engine_unreachable`:
        the proxy could not connect to any engine) and the backend answered it (`upstream_reset`: the
        proxy's own answer after the engine's connection was reset)."""
        streaming = "text/event-stream" in content_type
        ok = status is not None and status < 400
        reset = upstream_reset and not from_router
        sent = from_router or ok or reset or status not in PICKER_REFUSALS
        tracker = ResponseUsageTracker(
            streaming=streaming,
            encoding=admitted.policy.encoding,
            strip_usage_chunk=admitted.strip_usage and streaming and ok,
            dialect=dialect_for(admitted.request.api),
        )
        return cls(
            status=status,
            tracker=tracker,
            streaming=streaming,
            completed=end_of_stream,
            forwarded=not engine_unreachable and sent,
            engine_unreachable=engine_unreachable,
            engine_answered=not reset,
        )

    def seen(self, live: bool = False, decode_s: float | None = None) -> Seen:
        """What was seen so far; `live` for a chunk (the KV budget follows it), `decode_s` at the end."""
        tracker = self.tracker
        facts = ResponseFacts(
            upstream_status=self.status,
            completed=self.completed or tracker.done_seen,
            usage=tracker.usage,
            error_seen=tracker.error_seen,
            forwarded=self.forwarded,
            engine_answered=self.engine_answered,
            engine_unreachable=self.engine_unreachable,
        )
        return Seen(
            facts,
            streamed=self.streaming,
            live=live,
            content_since=self.first_chunk_at,
            decode_s=decode_s,
            passed_bytes=self.passed_bytes,
        )
