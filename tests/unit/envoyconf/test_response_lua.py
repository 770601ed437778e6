"""The lean profile's Lua response reader (extproc/envoyconf/response.lua), run by LuaJIT 2.1 (Envoy's Lua) in
process through `lupa`, against a stand-in for the parts of Envoy's Lua handle it uses.

The e2e suite runs the same script inside a real Envoy, where each upstream write is usually one chunk. Here
a response is cut at every byte position (and at random sets of positions), which Envoy may do too (TCP
segments, HTTP/2 frames): whatever the cuts, the reader must count the same events, capture the same usage,
and hand the client exactly the bytes the upstream sent, minus the usage event the sidecar injected. Its
output then goes through the sidecar's own end-report path (`reading_of` → `facts_of` → `settle_charge`).

The stand-in follows Envoy's Lua filter API (docs: envoy/docs/root/configuration/http/http_filters/
lua_filter.rst, Envoy 1.40): `handle:headers():get(name)`, `handle:bodyChunks()` yielding buffers with
`length()`, `getBytes(index, length)` (0-based index) and `setBytes(string)`, and
`handle:streamInfo():dynamicMetadata()` with `get(filter)` / `set(filter, key, value)`, and
`handle:timestamp()` (milliseconds since the epoch).
"""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lupa.luajit21 as lupa  # type: ignore[import-untyped]  # LuaJIT 2.1, as in Envoy
import pytest
from google.protobuf import struct_pb2

from extproc.admission.capacity.charging import Ending, settle_charge
from extproc.admission.intake.request import Api
from extproc.admission.tracking.reading import facts_of, spec_for
from extproc.protocol.accesslog import reading_of

SCRIPT = Path(__file__).resolve().parents[3] / "extproc" / "envoyconf" / "response.lua"
ENC = "cl100k_base"

HARNESS = """
local script = ...
local RESET = {}
local run = function(admitted, content_type, chunks, reset)
  local out, sent, chunk_list = {}, {}, {}
  local metadata = {
    get = function(_, filter) if filter == "extproc" then return admitted end return nil end,
    set = function(_, filter, key, value)
      if filter ~= "extproc.response" then error("unexpected namespace " .. filter) end
      out[key] = value
    end,
  }
  local info = { dynamicMetadata = function(_) return metadata end }
  local headers = { get = function(_, name) if name == "content-type" then return content_type end end }
  local current = 0
  local handle = {
    -- Envoy's clock in ms since the epoch; here chunk i arrives at 1,700,000,000,000 + 10 i.
    timestamp = function(_) return 1700000000000 + 10 * current end,
    streamInfo = function(_) return info end,
    headers = function(_) return headers end,
    bodyChunks = function(_)
      local i = 0
      return function()
        i = i + 1
        current = i
        if chunks[i] == nil then
          -- A reset stream (client gone, upstream crashed): Envoy never resumes the script. Stand-in: unwind.
          if reset then error(RESET) end
          return nil
        end
        local buffer = { bytes = chunks[i] }
        function buffer:length() return #self.bytes end
        function buffer:getBytes(index, length)
          if index < 0 or index + length > #self.bytes then error("getBytes out of range") end
          return string.sub(self.bytes, index + 1, index + length)
        end
        function buffer:setBytes(bytes) self.bytes = bytes end
        chunk_list[#chunk_list + 1] = buffer
        return buffer
      end
    end,
  }
  local env = setmetatable({}, { __index = _G })
  local chunk = assert(load(script, "response.lua", "t", env))
  chunk()
  local ok, err = pcall(env.envoy_on_response, handle)
  if not ok and err ~= RESET then error(err) end
  -- A chunk the script never asked for passes to the client as the upstream sent it.
  for i, bytes in ipairs(chunks) do sent[i] = chunk_list[i] and chunk_list[i].bytes or bytes end
  return out, table.concat(sent)
end
return run
"""


@dataclass(frozen=True)
class Seen:
    """What the reader wrote for the access log, and what the client received."""

    fields: dict[str, Any]
    client: bytes

    def struct(self) -> struct_pb2.Struct:
        """The metadata as Envoy's access log carries it (strings decoded as UTF-8, numbers as doubles)."""
        out = struct_pb2.Struct()
        for key, value in self.fields.items():
            out.update({key: value.decode() if isinstance(value, bytes) else value})
        return out


class Reader:
    def __init__(self) -> None:
        self.lua = lupa.LuaRuntime(encoding=None, unpack_returned_tuples=True)
        self._run = self.lua.execute(HARNESS.encode(), SCRIPT.read_bytes())

    def table(self, value: Any) -> Any:
        """A Python value as the Lua table Envoy builds from a protobuf Struct (lists are arrays)."""
        if isinstance(value, dict):
            return self.lua.table_from({k.encode(): self.table(v) for k, v in value.items()})
        if isinstance(value, list):
            return self.lua.table_from([self.table(v) for v in value])
        return value.encode() if isinstance(value, str) else value

    def read(
        self,
        api: Api | None,
        content_type: str,
        chunks: Sequence[bytes],
        strip: bool = False,
        reset: bool = False,
    ) -> Seen:
        """Run the script over `chunks`; `reset`: the stream is reset after them instead of ending."""
        admitted = None
        if api is not None:
            admitted = self.table({"id": "lease-1", "read": spec_for(api).to_struct(strip)})
        fields, client = self._run(admitted, content_type.encode(), self.lua.table_from(list(chunks)), reset)
        return Seen({k.decode(): v for k, v in fields.items()}, client)


@pytest.fixture(scope="module")
def reader() -> Reader:
    return Reader()


def sse(*payloads: dict[str, Any] | str, newline: str = "\n") -> bytes:
    """An SSE stream: each payload as one `data:` event (a str is sent as is, e.g. `[DONE]`)."""
    events = [f"data: {p if isinstance(p, str) else json.dumps(p)}{newline}{newline}" for p in payloads]
    return "".join(events).encode()


def chat_stream(tokens: int, usage: dict[str, Any] | None) -> tuple[bytes, bytes]:
    """A vLLM chat stream (role delta, one token per event, finish, optional usage-only chunk, [DONE]), and
    the same stream without the usage-only chunk (what a client that did not ask for usage must get)."""
    base = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": "m"}
    head = [{**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}]
    body = [{**base, "choices": [{"index": 0, "delta": {"content": f" t{i}"}}]} for i in range(tokens)]
    finish = [{**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}]
    usage_event = [{**base, "choices": [], "usage": usage}] if usage is not None else []
    full = sse(*head, *body, *finish, *usage_event, "[DONE]")
    return full, sse(*head, *body, *finish, "[DONE]")


def cuts(data: bytes, positions: Sequence[int]) -> list[bytes]:
    edges = [0, *sorted(set(positions)), len(data)]
    return [data[a:b] for a, b in itertools.pairwise(edges) if b > a]


def every_split(data: bytes) -> Iterator[list[bytes]]:
    """Every single cut, then 30 seeded random sets of 2-12 cuts, each also with an empty last chunk."""
    rng = random.Random(7)
    for at in range(1, len(data)):
        yield cuts(data, [at])
    for _ in range(30):
        chunks = cuts(data, rng.sample(range(1, len(data)), rng.randint(2, 12)))
        yield chunks
        yield [*chunks, b""]


USAGE = {"prompt_tokens": 12, "completion_tokens": 5, "total_tokens": 17}


def test_an_openai_stream_is_read_the_same_whatever_the_chunking(reader: Reader) -> None:
    full, without_usage = chat_stream(5, USAGE)
    for chunks in every_split(full):
        seen = reader.read(Api("chat"), "text/event-stream", chunks, strip=True)
        assert seen.client == without_usage, chunks
        assert seen.fields["n"] == 5 and seen.fields["m"] == 5 and seen.fields["f"] is True
        assert json.loads(seen.fields["u"]) == USAGE and seen.fields["x"] is True
        charge = settle_charge(12, facts_of(200, reading_of(seen.struct()), Api("chat"), ENC))
        assert (charge.ending, charge.prompt, charge.completion) == (Ending.COMPLETED, 12, 5)


def test_the_whole_usage_object_is_captured_with_its_prompt_tokens_details(reader: Reader) -> None:
    """vLLM's `--enable-prompt-tokens-details` nests an object in usage: `%b{}` keeps it whole."""
    usage = {**USAGE, "prompt_tokens_details": {"cached_tokens": 8}}
    full, _ = chat_stream(5, usage)
    for chunks in every_split(full):
        seen = reader.read(Api("chat"), "text/event-stream", chunks, strip=True)
        assert json.loads(seen.fields["u"]) == usage
        charge = settle_charge(12, facts_of(200, reading_of(seen.struct()), Api("chat"), ENC), 0.5)
        assert (charge.prompt, charge.completion, charge.cached) == (8, 5, 8)


def test_a_client_that_asked_for_usage_gets_every_byte(reader: Reader) -> None:
    full, _ = chat_stream(3, USAGE)
    for chunks in every_split(full):
        seen = reader.read(Api("chat"), "text/event-stream", chunks, strip=False)
        assert seen.client == full
        assert seen.fields["n"] == 3 and json.loads(seen.fields["u"]) == USAGE


def test_crlf_events_are_events_too(reader: Reader) -> None:
    full = sse(
        {"choices": [{"delta": {"content": "a"}}]},
        {"choices": [], "usage": USAGE},
        "[DONE]",
        newline="\r\n",
    )
    seen = reader.read(Api("chat"), "text/event-stream", cuts(full, [7, 40]), strip=True)
    assert seen.fields["n"] == 1 and json.loads(seen.fields["u"]) == USAGE
    assert b'"usage"' not in seen.client and seen.client.endswith(b"data: [DONE]\r\n\r\n")


def test_a_stream_cut_short_counts_its_content_events_and_is_not_final(reader: Reader) -> None:
    full, _ = chat_stream(8, USAGE)
    first_four = full[: full.index(b" t4")]  # ends inside the fifth token's event
    seen = reader.read(Api("chat"), "text/event-stream", cuts(first_four, [100, 333]), strip=True, reset=True)
    assert seen.fields["n"] == 4 and not {"f", "u", "x"} & seen.fields.keys()
    charge = settle_charge(12, facts_of(200, reading_of(seen.struct()), Api("chat"), ENC))
    assert (charge.ending, charge.completion) == (Ending.ABORTED, 4)


def test_an_error_event_marks_an_upstream_error(reader: Reader) -> None:
    full = sse(
        {"choices": [{"delta": {"content": "a"}}]},
        {"error": {"message": "engine died", "type": "InternalServerError", "code": 500}},
    )
    seen = reader.read(Api("chat"), "text/event-stream", [full], reset=True)
    assert seen.fields["e"] is True and seen.fields["n"] == 1
    facts = facts_of(200, reading_of(seen.struct()), Api("chat"), ENC)
    assert settle_charge(3, facts).ending is Ending.UPSTREAM_ERROR


def test_generated_text_that_quotes_error_or_usage_is_content(reader: Reader) -> None:
    tricky = [{"choices": [{"delta": {"content": t}}]} for t in ('"error": {', '"usage": {"a": 1}', "[DONE]")]
    full = sse(*tricky, {"choices": [], "usage": USAGE}, "[DONE]")
    seen = reader.read(Api("chat"), "text/event-stream", [full], strip=True)
    assert seen.fields["n"] == 3 and "e" not in seen.fields
    assert json.loads(seen.fields["u"]) == USAGE
    assert seen.client.count(b"data: ") == 4  # the three tricky events and [DONE]; only usage dropped


def test_anthropic_prompt_and_output_usage_come_from_two_events(reader: Reader) -> None:
    events: list[dict[str, Any]] = [
        {"type": "message_start", "message": {"usage": {"input_tokens": 21, "output_tokens": 1}}},
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
        *(
            {"type": "content_block_delta", "delta": {"type": "text_delta", "text": f"w{i}"}}
            for i in range(6)
        ),
        {"type": "content_block_stop", "index": 0},
        {"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 6}},
        {"type": "message_stop"},
    ]
    text = "".join(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n" for e in events).encode()
    for chunks in every_split(text):
        seen = reader.read(Api("messages"), "text/event-stream", chunks)
        assert seen.client == text
        charge = settle_charge(9, facts_of(200, reading_of(seen.struct()), Api("messages"), ENC))
        assert (charge.ending, charge.prompt, charge.completion) == (Ending.COMPLETED, 21, 6)


def test_a_json_body_is_handed_over_whole_up_to_64_kib_and_by_its_tail_past_it(reader: Reader) -> None:
    small = json.dumps({"choices": [{"message": {"content": "hi"}}], "usage": USAGE}).encode()
    seen = reader.read(Api("chat"), "application/json", cuts(small, [10, 20]))
    assert seen.fields["b"] == small and seen.client == small
    large = json.dumps({"choices": [{"message": {"content": "x" * 200_000}}], "usage": USAGE}).encode()
    seen = reader.read(Api("chat"), "application/json", cuts(large, range(16_384, len(large), 16_384)))
    assert "b" not in seen.fields and len(seen.fields["t"]) == 8192 and large.endswith(seen.fields["t"])
    assert seen.client == large
    charge = settle_charge(12, facts_of(200, reading_of(seen.struct()), Api("chat"), ENC))
    assert (charge.ending, charge.prompt, charge.completion) == (Ending.COMPLETED, 12, 5)


def test_a_response_the_sidecar_did_not_admit_is_left_alone(reader: Reader) -> None:
    full, _ = chat_stream(2, USAGE)
    seen = reader.read(None, "text/event-stream", cuts(full, [50]))
    assert seen.fields == {} and seen.client == full


def test_the_first_content_event_is_timed_once(reader: Reader) -> None:
    full, _ = chat_stream(4, USAGE)
    first_token = full.index(b" t0")
    chunks = [full[:first_token], full[first_token : first_token + 200], full[first_token + 200 :]]
    seen = reader.read(Api("chat"), "text/event-stream", chunks, strip=True)
    # Chunk 1 holds only the role delta (no content); chunk 2 the first token: its arrival time.
    assert seen.fields["t1"] == 1_700_000_000_000 + 10 * 2
    assert reading_of(seen.struct()).first_content_ms == 1_700_000_000_020.0
    body = reader.read(Api("chat"), "application/json", [json.dumps({"usage": USAGE}).encode()])
    assert "t1" not in body.fields  # a JSON answer has no content events to time


def test_every_blank_line_form_ends_an_event(reader: Reader) -> None:
    """The reader finds event ends with plain newline searches: "\\n\\n", "\\r\\n\\r\\n", "\\n\\r\\n" and
    "\\r\\n\\n" all end an event (the forms of the pattern `\\r?\\n\\r?\\n`), wherever the chunks are cut."""
    delta = 'data: {"choices":[{"delta":{"content":"a"}}]}'
    usage = f"data: {json.dumps({'choices': [], 'usage': USAGE})}"
    text = f"{delta}\n\n{delta}\r\n\r\n{delta}\n\r\n{delta}\r\n\n{usage}\r\n\n{delta}\n\ndata: [DONE]\n\r\n"
    expected = text.replace(f"{usage}\r\n\n", "").encode()
    for chunks in every_split(text.encode()):
        seen = reader.read(Api("chat"), "text/event-stream", chunks, strip=True)
        assert seen.client == expected, chunks
        assert (seen.fields["n"], seen.fields["m"], seen.fields["f"]) == (5, 4, True)
        assert json.loads(seen.fields["u"]) == USAGE


def test_a_lone_newline_or_a_bare_carriage_return_does_not_end_an_event(reader: Reader) -> None:
    text = b'data: {"choices":[{"delta":{"content":"a\\nb"}}]}\nid: 7\r\r\n\n'
    seen = reader.read(Api("chat"), "text/event-stream", [text[:50], text[50:]])
    assert seen.fields["n"] == 1 and seen.client == text


def test_a_pattern_matching_past_the_first_occurrence_of_its_literal_start_still_matches(
    reader: Reader,
) -> None:
    """The plain search finds the first `"content"`: an empty or null one must not hide a later match."""
    events: list[dict[str, Any]] = [
        {"choices": [{"delta": {"content": None, "tool_calls": [{"function": {"arguments": "{}"}}]}}]},
        {"choices": [{"delta": {"content": ""}}], "x": {"content": "late"}},
        {"choices": [{"delta": {"content": ""}}]},  # role-only delta: no content
    ]
    seen = reader.read(Api("chat"), "text/event-stream", [sse(*events, "[DONE]")])
    assert seen.fields["n"] == 2 and seen.fields["f"] is True


def test_an_event_error_line_marks_an_error_first_in_the_event_or_after_an_id(reader: Reader) -> None:
    """`^event:%s*error%s` (anchored, no literal start) and `\\nevent:%s*error%s` (after an `id:` line)."""
    first = b'event: error\ndata: {"message": "overloaded"}\n\n'
    after_id = b'id: 3\nevent: error\ndata: {"message": "overloaded"}\n\n'
    content = b'data: {"choices":[{"delta":{"content":"event: error "}}]}\n\n'
    for text in (first, content + after_id):
        assert reader.read(Api("chat"), "text/event-stream", [text], reset=True).fields["e"] is True
    assert "e" not in reader.read(Api("chat"), "text/event-stream", [content], reset=True).fields


def test_a_responses_stream_counts_deltas_but_not_audio_and_reads_the_final_usage(reader: Reader) -> None:
    def event(payload: dict[str, Any]) -> str:
        return f"event: {payload['type']}\ndata: {json.dumps(payload)}\n\n"

    usage = {"input_tokens": 9, "output_tokens": 4, "total_tokens": 13}
    events: list[dict[str, Any]] = [
        {"type": "response.created", "response": {"id": "r1", "usage": None}},
        *({"type": "response.output_text.delta", "delta": f"w{i}"} for i in range(3)),
        {"type": "response.audio.delta", "delta": "AAAA"},
        {"type": "response.reasoning_text.delta", "delta": "hm"},
        {"type": "response.completed", "response": {"id": "r1", "usage": usage}},
    ]
    text = "".join(event(e) for e in events).encode()
    for chunks in every_split(text):
        seen = reader.read(Api("responses"), "text/event-stream", chunks)
        assert seen.client == text
        assert (seen.fields["n"], seen.fields["f"]) == (4, True) and json.loads(seen.fields["u"]) == usage
        charge = settle_charge(9, facts_of(200, reading_of(seen.struct()), Api("responses"), ENC))
        assert (charge.ending, charge.prompt, charge.completion) == (Ending.COMPLETED, 9, 4)


def test_sglang_usage_on_every_event_keeps_the_last_one(reader: Reader) -> None:
    events = [
        {"text": "a" * (i + 1), "meta_info": {"id": "q", "prompt_tokens": 7, "completion_tokens": i + 1}}
        for i in range(5)
    ]
    text = sse(*events, "[DONE]")
    seen = reader.read(Api("sglang_generate"), "text/event-stream", cuts(text, [30, 200, 201]))
    assert (seen.fields["n"], seen.fields["m"]) == (5, 5)
    assert json.loads(seen.fields["u0"])["completion_tokens"] == 1
    assert json.loads(seen.fields["u"])["completion_tokens"] == 5
    charge = settle_charge(7, facts_of(200, reading_of(seen.struct()), Api("sglang_generate"), ENC))
    assert (charge.ending, charge.prompt, charge.completion) == (Ending.COMPLETED, 7, 5)


def cohere_stream(end: dict[str, Any]) -> bytes:
    """A vLLM Cohere chat v2 stream (vLLM v0.32.0 entrypoints/cohere/serving.py:1425-1551): `data:` only,
    typed events, one generated delta per content event, `message-end`, then `[DONE]`."""
    message: list[dict[str, Any]] = [
        {"id": "c", "type": "message-start", "delta": {"message": {"role": "assistant"}}},
        {
            "type": "content-start",
            "index": 0,
            "delta": {"message": {"content": {"type": "text", "text": ""}}},
        },
        *(
            {"type": "content-delta", "index": 0, "delta": {"message": {"content": {"text": f"w{i}"}}}}
            for i in range(3)
        ),
        {"type": "citation-start", "index": 0, "delta": {"message": {"citations": {"text": "w0"}}}},
        {"type": "content-end", "index": 0},
        {"type": "tool-plan-delta", "delta": {"message": {"tool_plan": "zoom"}}},
        {
            "type": "tool-call-start",
            "index": 0,
            "delta": {"message": {"tool_calls": {"function": {"name": "z"}}}},
        },
        {
            "type": "tool-call-delta",
            "index": 0,
            "delta": {"message": {"tool_calls": {"function": {"arguments": "{}"}}}},
        },
        {"type": "tool-call-end", "index": 0},
    ]
    return sse(*message, end, "[DONE]")


def test_a_cohere_stream_counts_its_deltas_and_reads_the_float_usage_of_message_end(reader: Reader) -> None:
    usage = {
        "billed_units": {"input_tokens": 9.0, "output_tokens": 6.0},
        "tokens": {"input_tokens": 9.0, "output_tokens": 6.0},
    }
    text = cohere_stream(
        {"id": "c", "type": "message-end", "delta": {"finish_reason": "COMPLETE", "usage": usage}}
    )
    for chunks in every_split(text):
        seen = reader.read(Api("cohere_chat"), "text/event-stream", chunks, strip=True)
        assert seen.client == text  # nothing to strip: vLLM always streams Cohere's usage
        assert (seen.fields["n"], seen.fields["f"]) == (6, True) and json.loads(seen.fields["u"]) == usage
        charge = settle_charge(9, facts_of(200, reading_of(seen.struct()), Api("cohere_chat"), ENC))
        assert (charge.ending, charge.prompt, charge.completion) == (Ending.COMPLETED, 9, 6)


def test_a_cohere_stream_that_fails_mid_answer_is_an_upstream_error(reader: Reader) -> None:
    text = cohere_stream({"type": "message-end", "delta": {"error": "engine died", "finish_reason": "ERROR"}})
    seen = reader.read(Api("cohere_chat"), "text/event-stream", [text])
    assert seen.fields["e"] is True and seen.fields["n"] == 6
    facts = facts_of(200, reading_of(seen.struct()), Api("cohere_chat"), ENC)
    assert settle_charge(3, facts).ending is Ending.UPSTREAM_ERROR
