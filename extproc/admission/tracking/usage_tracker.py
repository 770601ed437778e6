"""The inline profile's tracker of a response's usage as it streams, in the API's dialect
(extproc/admission/vocabulary/usage.py). Settlement charges from it (extproc/admission/capacity/charging.py).

A `ResponseUsageTracker` sees every response body chunk, in order, and keeps the best knowledge of the
request's usage at every moment, so settlement works however the response ends.

Settlement facts the server relies on:

* `usage.reported` is True once the backend's own `usage` object was seen (a non-streaming body, the
  include_usage event at the end of a stream, or continuous usage on every event). Its `completion_tokens`
  is then authoritative; tokens of content events after the last usage object are counted and added.
* Without a usage object, `completion_tokens` is counted with tiktoken from the text that passed:
  `delta.content`, `delta.reasoning_content` (or `delta.reasoning`), tool call / function call names and
  arguments (chat) and `text` (completions), over all choices. Each delta is tokenized on its own (the
  answer is never buffered), so the count can differ from tokenizing the joined answer at each delta join:
  by at most one token lower per join in our tests, and a few higher when a long word is split mid-way.
  Real backends send about one token per delta, where the two agree exactly. For a backend with another
  tokenizer the count is an estimate in the sidecar's encoding.
* `prompt_tokens` is None unless reported: the server keeps its own count from admission.
* `cached_prompt_tokens` is the part of the prompt the engine's prefix cache served, when the backend
  reports it (chat and completions: `usage.prompt_tokens_details.cached_tokens`, which vLLM writes only when
  started with `--enable-prompt-tokens-details`; Responses and Anthropic have their own fields, read by
  their dialects), else None: nothing is guessed, so an unreported hit is charged in full.
* A stream cut mid-way (client disconnect, backend failure) gets no usage event; `usage` is valid at any
  time and then reports what was counted so far.
* `error_seen` is True after an SSE error event (`event: error`, `data: {"error": ...}`,
  `data: {"object": "error", ...}`) or a JSON error body. A streaming request answered with a JSON body (an
  error before streaming began) is recognised by its leading `{` and parsed as JSON.
* Nothing here raises on malformed input: garbage, truncated JSON, non-JSON bodies and oversized events are
  skipped and usage reports what is known. Memory is bounded by `max_buffer_bytes`: streaming keeps only the
  current incomplete event; a non-streaming body is kept up to the cap, and past it only its last
  `TAIL_BYTES`, from which the usage object (written after the choices) is still read at `finish()`.
* What an event or body means is the API's `Dialect` (each API's module under `extproc/admission/apis/`
  has one; OpenAI chunks are `apis/openai.py`'s): where generated text, usage, errors and the final event
  are.
* With `strip_usage_chunk=True` (the sidecar injected include_usage; the client did not ask) the usage-only
  event (`"choices": []` plus usage) is removed from the bytes sent to the client. To do so an incomplete
  trailing event is held back and released with the next chunk or by `finish()`; the caller must send what
  `finish()` returns. Other events' `"usage": null` fields are left as they are. With False, bytes never
  change and nothing is held back.
* `finish()` on a non-streaming body parses and may tokenize up to `max_buffer_bytes` of JSON: run it in a
  worker thread for large bodies. Streaming work per event is small (one JSON event, a few short deltas).
* A tracker is not thread-safe; use one per response.
"""

from __future__ import annotations

import json

from extproc.admission.vocabulary.tokens import count_text
from extproc.admission.vocabulary.usage import Dialect, Observed, Usage

TAIL_BYTES = 256 * 1024
"""Bytes kept from the end of a non-streamed body larger than the buffer cap: its usage object lives there."""

_SSE = "sse"
_JSON = "json"


class ResponseUsageTracker:
    """Follows one response body (SSE or JSON) to learn its token usage; see the module docstring."""

    def __init__(
        self,
        *,
        streaming: bool,
        encoding: str,
        strip_usage_chunk: bool = False,
        max_buffer_bytes: int = 8 << 20,
        dialect: Dialect,
    ) -> None:
        self._dialect = dialect
        self._encoding = encoding
        self._strip = strip_usage_chunk and streaming
        self._cap = max_buffer_bytes
        self._mode: str | None = None if streaming else _JSON
        self._finished = False
        # SSE parser state: the current partial line and the current event's fields.
        self._line = bytearray()
        self._line_overflow = False
        self._data: list[bytes] = []
        self._data_size = 0
        self._event_overflow = False
        self._event_name = b""
        # Strip mode: raw bytes of the incomplete current event, held back until it is known to be kept.
        self._held = bytearray()
        self._passthrough = False  # current event outgrew the cap: its bytes are released as they come
        # JSON body state.
        self._body = bytearray()
        self._body_overflow = False
        self._tail = bytearray()  # the last TAIL_BYTES of a body past the cap, where its usage lives
        # Results.
        self._usage_seen = False
        self._reported_prompt: int | None = None
        self._reported_completion: int | None = None
        self._reported_cached: int | None = None
        self._counted_total = self._counted_since_report = 0
        self._certain_total = self._certain_since_report = 0  # a token a text, and ids: `certain_completion`
        self._error = False
        self.done_seen = False  # the final event arrived (`data: [DONE]`, or the API's terminal event)

    # ----------------------------------------------------------------------------------------------------
    # Public API

    def feed(self, chunk: bytes) -> bytes | None:
        """Observe the next body chunk; return None to pass it unchanged, or the bytes to send instead."""
        if not chunk:
            return None
        if self._mode is None:
            head = chunk.lstrip()
            if not head:
                return None  # leading whitespace decides nothing and passes through
            self._mode = _JSON if head[:1] in (b"{", b"[") else _SSE
        if self._mode == _JSON:
            self._buffer_json(chunk)
            return None
        out = self._feed_sse(chunk)
        if out is None or out == chunk:
            return None
        return bytes(out)

    @property
    def buffered_bytes(self) -> int:
        """Bytes of a non-streamed body held for parsing at `finish` (to decide where to run it)."""
        return len(self._body)

    def finish(self) -> bytes | None:
        """End of the body: settle anything pending; return bytes held back (None when there are none)."""
        if self._finished:
            return None
        self._finished = True
        if self._mode == _JSON:
            self._settle_json()
            return None
        if self._mode != _SSE:
            return None
        out = bytearray() if self._strip else None
        if self._line or self._line_overflow:
            self._process_line(self._take_line(b""), out)
        if self._data or self._event_overflow or self._event_name or self._held:
            self._dispatch(out)
        return bytes(out) if out else None

    @property
    def usage(self) -> Usage:
        """Best knowledge so far; valid at any time, e.g. after a disconnect mid-stream."""
        reported = self._reported_completion
        completion = self._counted_total if reported is None else reported + self._counted_since_report
        certain = self._certain_total if reported is None else reported + self._certain_since_report
        return Usage(
            prompt_tokens=self._reported_prompt,
            completion_tokens=completion,
            reported=self._usage_seen,
            cached_prompt_tokens=self._reported_cached,
            certain_completion=min(certain, completion),
        )

    @property
    def error_seen(self) -> bool:
        """An SSE error event or an {"error": ...} JSON body was seen."""
        return self._error

    # ----------------------------------------------------------------------------------------------------
    # SSE

    def _feed_sse(self, chunk: bytes) -> bytearray | None:
        out = bytearray() if self._strip else None
        pos = 0
        size = len(chunk)
        while pos < size:
            nl = chunk.find(b"\n", pos)
            if nl < 0:
                piece = chunk[pos:]
                self._hold(piece, out)
                if not self._line_overflow:
                    self._line += piece
                    if len(self._line) > self._cap:
                        self._line_overflow = True
                        self._line.clear()
                break
            segment = chunk[pos : nl + 1]
            self._hold(segment, out)
            self._process_line(self._take_line(segment[:-1]), out)
            pos = nl + 1
        return out

    def _hold(self, raw: bytes, out: bytearray | None) -> None:
        """Strip mode: keep the current event's raw bytes until its fate is known, within the cap."""
        if out is None:
            return
        if self._passthrough:
            out += raw
            return
        self._held += raw
        if len(self._held) > self._cap:
            # Too large to hold: release it unparsed for stripping; a usage event is never this big.
            out += self._held
            self._held.clear()
            self._passthrough = True

    def _take_line(self, tail: bytes) -> bytes | None:
        """The complete current line (without its EOL), or None if it overflowed the cap."""
        if self._line_overflow:
            self._line_overflow = False
            self._line.clear()
            return None
        if self._line:
            line = bytes(self._line) + tail
            self._line.clear()
        else:
            line = tail
        return line[:-1] if line.endswith(b"\r") else line

    def _process_line(self, line: bytes | None, out: bytearray | None) -> None:
        if line is None:
            self._event_overflow = True
            return
        if not line:
            self._dispatch(out)
            return
        if line.startswith(b":"):
            return  # comment / keep-alive
        field, _, value = line.partition(b":")
        if value.startswith(b" "):
            value = value[1:]
        if field == b"data":
            if self._event_overflow:
                return
            self._data.append(value)
            self._data_size += len(value)
            if self._data_size > self._cap:
                self._event_overflow = True
                self._data.clear()
        elif field == b"event":
            self._event_name = value
        # id:, retry: and unknown fields carry nothing for usage

    def _dispatch(self, out: bytearray | None) -> None:
        """An event is complete: learn from it, then release or drop its held bytes."""
        drop = False
        if self._event_name == b"error":
            self._error = True
        if self._data and not self._event_overflow:
            drop = self._handle_data(b"\n".join(self._data), self._event_name)
        if out is not None and not self._passthrough:
            if not drop:
                out += self._held
            self._held.clear()
        self._data.clear()
        self._data_size = 0
        self._event_overflow = False
        self._event_name = b""
        self._passthrough = False

    def _handle_data(self, data: bytes, name: bytes) -> bool:
        """Absorb one event's data; True when it is the usage-only event the client did not ask for."""
        if data.strip() == b"[DONE]":
            self.done_seen = True
            return False
        try:
            obj = json.loads(data)
        except (ValueError, RecursionError):
            return False
        if not isinstance(obj, dict):
            return False
        seen = self._dialect.event(name, obj)
        self._absorb(seen)
        return self._strip and seen.usage_only

    # ----------------------------------------------------------------------------------------------------
    # JSON

    def _buffer_json(self, chunk: bytes) -> None:
        if self._body_overflow:
            self._keep_tail(chunk)
            return
        if len(self._body) + len(chunk) > self._cap:
            self._body_overflow = True
            self._keep_tail(bytes(self._body[-TAIL_BYTES:]) + chunk)
            self._body = bytearray()  # release the memory, not just the length
            return
        self._body += chunk

    def _keep_tail(self, chunk: bytes) -> None:
        self._tail += chunk
        if len(self._tail) > TAIL_BYTES:
            del self._tail[: len(self._tail) - TAIL_BYTES]

    def _settle_json(self) -> None:
        if self._body_overflow:
            self._settle_tail()
            return
        if not self._body:
            return
        try:
            obj = json.loads(bytes(self._body))
        except (ValueError, RecursionError):
            return
        finally:
            self._body = bytearray()
        seen = self._dialect.body(obj)
        if seen.usage_seen and seen.completion is not None:
            seen.texts = []  # authoritative: no need to tokenize the answer
            seen.tokens = 0
        self._absorb(seen)

    def _settle_tail(self) -> None:
        """A body past the cap (e.g. with 20 logprobs per token): read the last `"usage"` object in its tail.

        The answer's own text is not counted (it is gone); the usage object, which OpenAI-style servers write
        after the choices, is parsed from the last occurrence of the key that decodes as an object.
        """
        tail = bytes(self._tail)
        self._tail = bytearray()
        decoder = json.JSONDecoder()
        end = len(tail)
        while True:
            at = tail.rfind(b'"usage"', 0, end)
            if at < 0:
                return
            colon = tail.find(b":", at + 7)
            try:
                text = tail[colon + 1 :].decode("utf-8", "replace").lstrip()
                usage, _ = decoder.raw_decode(text)
            except (ValueError, RecursionError):
                end = at
                continue
            if isinstance(usage, dict):
                self._absorb(self._dialect.body({"usage": usage}))
                return
            end = at

    # ----------------------------------------------------------------------------------------------------
    # Shared

    def _absorb(self, seen: Observed) -> None:
        """Fold one event's or body's observations into the running usage."""
        if seen.error:
            self._error = True
        if seen.final:
            self.done_seen = True
        counted = seen.tokens + sum(count_text(t, self._encoding) for t in seen.texts if t)
        self._counted_total += counted
        self._counted_since_report += counted
        certain = seen.tokens + sum(1 for t in seen.texts if t)
        self._certain_total += certain
        self._certain_since_report += certain
        if not seen.usage_seen:
            return
        self._usage_seen = True
        if seen.prompt is not None:
            self._reported_prompt = seen.prompt
        if seen.cached is not None:
            self._reported_cached = seen.cached
        if seen.completion is not None:
            self._reported_completion = seen.completion
            self._counted_since_report = 0
            self._certain_since_report = 0
