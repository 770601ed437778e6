"""The lean profile's response path: what the proxy reads for the sidecar, and the facts it settles on.

In the lean profile the sidecar sees only the request. Envoy reads the response with a Lua filter
(extproc/envoyconf/response.lua) that knows no API: at admission the sidecar hands it the API's `ReadSpec`
(Lua patterns in the API's spec under `extproc/admission/apis/`, matching what its `Dialect` reads), and when
the request ends Envoy's access log brings back what the filter saw (`ResponseReading`). `facts_of` turns
that into the same `ResponseFacts` the inline profile learns message by message, and the one charging rule
(settlement.py) applies.

What the filter reports, per response:

* A streamed answer (SSE): the number of content events (events carrying generated text or token ids),
  the first and the last usage object as text (Anthropic reports the prompt in `message_start` and the
  output in `message_delta`; the others report once, at the end or on every event), how many content events
  had passed when the last usage object was seen, and whether a final or an error event was seen.
* The usage object is captured whole (the pattern takes its balanced braces), so nested fields such as
  `prompt_tokens_details.cached_tokens` reach the dialect as they do in the inline profile.
* A JSON answer: the body itself up to 64 KiB, past that its last 8 KiB, from which the usage object (written
  after the choices) is read the way the inline profile reads a body larger than its buffer.

Differences from the inline profile, all in what is charged when the backend reports no usage (a client
disconnect or a crash mid-stream): the inline profile counts the streamed text with the tokenizer, the lean
profile counts content events, one token each. vLLM and SGLang stream one token per event unless told to
batch them (`--stream-interval`), so the two agree; the simulator's tests check it token for token. A
function call's name (read from `output_item.added` or `content_block_start`) is not counted.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from extproc.admission.apis import dialect_for, spec_of
from extproc.admission.apis.openai import OPENAI_SPEC
from extproc.admission.capacity.charging import ResponseFacts
from extproc.admission.tracking.usage_tracker import ResponseUsageTracker
from extproc.admission.vocabulary.parsed import Api
from extproc.admission.vocabulary.readspec import ReadSpec
from extproc.admission.vocabulary.usage import Observed, Usage

__all__ = [
    "OPENAI_SPEC",
    "ReadSpec",
    "ReportedTiming",
    "ResponseReading",
    "facts_of",
    "spec_for",
]


def spec_for(api: Api) -> ReadSpec:
    """How the proxy reads this API's streamed answers (its `ApiSpec.read`)."""
    return spec_of(api).read


@dataclass(frozen=True, slots=True)
class ResponseReading:
    """What the proxy's reader saw of one response (see the module docstring); empty when it never ran
    (an Envoy local reply, or a response that never started)."""

    events: int = 0
    events_at_usage: int = 0
    usage_first: str | None = None
    usage_last: str | None = None
    final: bool = False
    error: bool = False
    body_end: bool = False
    body: str | None = None
    tail: str | None = None
    first_content_ms: float | None = None  # Envoy's clock when the first content event arrived

    @property
    def streamed(self) -> bool:
        """The answer was an event stream (the reader captured no JSON body)."""
        return self.body is None and self.tail is None and self.seen

    @property
    def seen(self) -> bool:
        return (
            self.body_end
            or self.events > 0
            or self.usage_last is not None
            or self.final
            or self.error
            or self.body is not None
            or self.tail is not None
        )


@dataclass(frozen=True, slots=True)
class ReportedTiming:
    """When a streamed answer's tokens came, from the end report: seconds from the request's start to its
    first content event (queueing and prefill, plus the admission itself), and from that event to the last
    upstream byte (decoding); `upstream_s`, from the start to the last upstream byte (or to the stream's end
    where the upstream's answer never ended), streamed or not. None where the report does not tell."""

    first_token_after_s: float | None
    decode_s: float | None
    upstream_s: float | None = None


def facts_of(status: int | None, reading: ResponseReading, api: Api, encoding: str) -> ResponseFacts:
    """The settlement facts of a response the proxy read: `status` is the response code (None when no
    response started), `api` the request's resolved API (its dialect parses what was captured)."""
    if reading.body is not None or reading.tail is not None:
        usage, error, final = _body_usage(reading, api, encoding)
    elif reading.seen:
        usage, error, final = _event_usage(reading, api), reading.error, reading.final
    else:
        return ResponseFacts(upstream_status=status)
    return ResponseFacts(
        upstream_status=status,
        completed=reading.body_end or final,
        usage=usage,
        error_seen=error,
    )


def _body_usage(reading: ResponseReading, api: Api, encoding: str) -> tuple[Usage, bool, bool]:
    """A JSON answer, parsed by the API's dialect exactly as the inline profile parses it; a tail is read
    the way a body past the inline profile's buffer is (its last usage object)."""
    whole = reading.body is not None
    text = reading.body if whole else reading.tail
    assert text is not None
    # Past a buffer of 0 bytes the tracker keeps only the tail, and reads the usage object from it.
    tracker = ResponseUsageTracker(
        streaming=False,
        encoding=encoding,
        dialect=dialect_for(api),
        max_buffer_bytes=(8 << 20) if whole else 0,
    )
    tracker.feed(text.encode("utf-8", "replace"))
    tracker.finish()
    return tracker.usage, tracker.error_seen, tracker.done_seen


def _event_usage(reading: ResponseReading, api: Api) -> Usage:
    """Usage from the captured usage objects, plus content events after the last one; without any usage
    object, the content events counted (one token each)."""
    key = spec_for(api).usage_key
    dialect = dialect_for(api)
    prompt: int | None = None
    completion: int | None = None
    cached: int | None = None
    seen = False
    for text in (reading.usage_first, reading.usage_last):
        observed = _observe(dialect.body, key, text)
        if observed is None:
            continue
        seen = seen or observed.usage_seen
        if observed.prompt is not None:
            prompt = observed.prompt
        if observed.completion is not None:
            completion = observed.completion
        if observed.cached is not None:
            cached = observed.cached
    if completion is None:
        completion, after = reading.events, 0
    else:
        after = max(0, reading.events - reading.events_at_usage)
    return Usage(
        prompt_tokens=prompt, completion_tokens=completion + after, reported=seen, cached_prompt_tokens=cached
    )


def _observe(read: Any, key: str, text: str | None) -> Observed | None:
    if not text:
        return None
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return None
    if not isinstance(value, dict):
        return None
    observed: Observed = read({key: value})
    return observed
