"""The lean profile's end-report facts: what the Lua reader captured, parsed by each API's dialect."""

from __future__ import annotations

import json
from dataclasses import replace

from extproc.admission.apis import REGISTRY
from extproc.admission.capacity.charging import (
    Ending,
    ResponseFacts,
    cached_discount,
    ending_of,
    settle_charge,
)
from extproc.admission.intake.request import Api
from extproc.admission.tracking.reading import ReadSpec, ResponseReading, facts_of, spec_for

ENC = "cl100k_base"


def usage(**counts: int) -> str:
    return json.dumps(counts)


def test_a_completed_stream_settles_to_the_reported_usage() -> None:
    reading = ResponseReading(
        events=30, events_at_usage=30, usage_last=usage(prompt_tokens=12, completion_tokens=30), final=True
    )
    facts = facts_of(200, reading, Api("chat"), ENC)
    assert facts.completed and facts.usage is not None and facts.usage.reported
    assert settle_charge(10, facts).total == 12 + 30
    assert ending_of(facts) is Ending.COMPLETED


def test_without_usage_each_content_event_is_one_token_and_the_prompt_is_the_admission_count() -> None:
    facts = facts_of(200, ResponseReading(events=7), Api("chat"), ENC)
    assert not facts.completed
    charge = settle_charge(10, facts)
    assert (charge.ending, charge.prompt, charge.completion) == (Ending.ABORTED, 10, 7)


def test_anthropic_prompt_from_message_start_and_output_from_message_delta() -> None:
    reading = ResponseReading(
        events=9,
        events_at_usage=9,
        usage_first=usage(input_tokens=20, output_tokens=1),
        usage_last=usage(output_tokens=9),
        final=True,
    )
    charge = settle_charge(5, facts_of(200, reading, Api("messages"), ENC))
    assert (charge.prompt, charge.completion) == (20, 9)


def test_content_after_the_last_usage_object_is_added() -> None:
    reading = ResponseReading(events=12, events_at_usage=4, usage_last=usage(input_tokens=3, output_tokens=4))
    assert settle_charge(3, facts_of(200, reading, Api("messages"), ENC)).completion == 4 + 8


def test_a_json_body_is_parsed_whole_and_an_error_event_is_an_upstream_error() -> None:
    body = json.dumps({"choices": [{"message": {"content": "hi"}}], "usage": usage_dict(3, 2)})
    facts = facts_of(200, ResponseReading(body=body, body_end=True), Api("chat"), ENC)
    assert facts.completed and settle_charge(9, facts).total == 5
    failed = facts_of(200, ResponseReading(events=3, error=True), Api("chat"), ENC)
    assert ending_of(failed) is Ending.UPSTREAM_ERROR and settle_charge(9, failed).completion == 3


def usage_dict(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion}


def test_the_tail_of_a_large_body_still_gives_its_usage() -> None:
    tail = '..."index": 0}], "usage": {"prompt_tokens": 400, "completion_tokens": 0, "total_tokens": 400}}'
    facts = facts_of(200, ResponseReading(tail=tail, body_end=True), Api("embeddings"), ENC)
    assert settle_charge(10, facts).prompt == 400


def test_nothing_seen_leaves_the_estimate_to_the_exchange() -> None:
    facts = facts_of(None, ResponseReading(), Api("chat"), ENC)
    assert facts.upstream_status is None and facts.usage is None and not facts.completed


def test_garbage_usage_text_is_ignored() -> None:
    facts = facts_of(200, ResponseReading(events=2, usage_last="{not json"), Api("chat"), ENC)
    assert settle_charge(1, facts).completion == 2


def test_every_api_has_a_spec_with_a_usage_capture_and_strips_only_usage_option_apis() -> None:
    for entry in REGISTRY:
        spec = spec_for(entry.api)
        assert isinstance(spec, ReadSpec) and spec.usage_pattern.endswith("(%b{})")
        struct = spec.to_struct(strip=True)
        assert struct["strip"] is True and struct["content"] and struct["final"] and struct["error"]
    assert spec_for(Api("sglang_generate")).usage_key == "meta_info"
    assert spec_for(Api("messages")).usage_only is None


def test_a_request_never_forwarded_is_charged_nothing_whatever_its_reply() -> None:
    """Answered by a filter after the sidecar (an endpoint picker's 429 or 503): the engine never saw it."""
    for status in (429, 503, None):
        reading = ResponseReading(body='{"error":{"message":"no endpoint"}}', body_end=True)
        facts = replace(facts_of(status, reading, Api("chat"), ENC), forwarded=False)
        charge = settle_charge(40, facts)
        assert (charge.ending, charge.prompt, charge.completion) == (Ending.NOT_FORWARDED, 0, 0)
    # A cut is the sidecar's own doing and keeps its rule.
    cut = settle_charge(40, ResponseFacts(cut=True, forwarded=False))
    assert (cut.ending, cut.prompt) == (Ending.CUT, 40)


VLLM_QUEUE_FULL = (
    '{"error":{"message":"The engine is currently busy and cannot accept new requests. Please try again '
    'later or on a different instance.","type":"Service Unavailable","param":null,"code":503}}'
)
"""vLLM 0.32.0's answer past --max-num-queued-reqs: `QueueOverflowError` (vllm/exceptions.py) rendered by
create_error_response (vllm/entrypoints/serve/exception_handling/error_response.py)."""


def test_an_engine_503_is_its_queue_full_and_refunded_in_full() -> None:
    """The engine refused before its scheduler saw the request: nothing charged, counted apart."""
    reading = ResponseReading(body=VLLM_QUEUE_FULL, body_end=True)
    facts = facts_of(503, reading, Api("chat"), ENC)
    assert facts.engine_busy
    charge = settle_charge(40, facts)
    assert (charge.ending, charge.prompt, charge.completion) == (Ending.ENGINE_BUSY, 0, 0)
    # No body seen (a local reply's reader never ran, or an inline answer settled at its headers): the same.
    assert settle_charge(40, ResponseFacts(upstream_status=503)).ending is Ending.ENGINE_BUSY


def test_a_503_the_proxy_made_or_another_error_keeps_the_backend_error_rule() -> None:
    """Envoy's own 503 after the request went upstream (a reset before the response): the engine may have
    read the prompt. Other statuses, and 529 (not verified from Dynamo's source), are engine errors."""
    made = settle_charge(40, ResponseFacts(upstream_status=503, engine_answered=False))
    assert (made.ending, made.prompt) == (Ending.UPSTREAM_ERROR, 40)
    for status in (500, 502, 504, 529, 429):
        charge = settle_charge(40, ResponseFacts(upstream_status=status))
        assert (charge.ending, charge.prompt) == (Ending.UPSTREAM_ERROR, 40), status
    # Never forwarded wins (an endpoint picker's 503), and a cut keeps its rule.
    assert (
        settle_charge(40, ResponseFacts(upstream_status=503, forwarded=False)).ending is Ending.NOT_FORWARDED
    )
    assert settle_charge(40, ResponseFacts(upstream_status=503, cut=True)).ending is Ending.CUT


def cached_usage(prompt: int, completion: int, cached: int) -> str:
    return json.dumps({**usage_dict(prompt, completion), "prompt_tokens_details": {"cached_tokens": cached}})


def test_the_lean_profile_reads_cached_prompt_tokens_from_the_captured_usage_and_body() -> None:
    """The Lua reader captures the whole usage object, nested details included (test_response_lua.py)."""
    reading = ResponseReading(events=5, events_at_usage=5, usage_last=cached_usage(40, 5, 32), final=True)
    streamed = facts_of(200, reading, Api("chat"), ENC).usage
    assert streamed is not None and streamed.cached_prompt_tokens == 32
    body = '{"choices": [], "usage": ' + cached_usage(40, 5, 16) + "}"
    whole = facts_of(200, ResponseReading(body=body, body_end=True), Api("completions"), ENC).usage
    assert whole is not None and whole.cached_prompt_tokens == 16
    plain = ResponseReading(events=5, events_at_usage=5, usage_last=usage(prompt_tokens=40), final=True)
    none = facts_of(200, plain, Api("chat"), ENC).usage
    assert none is not None and none.cached_prompt_tokens is None


def test_cached_prompt_tokens_are_charged_at_their_weight_and_rounded_up() -> None:
    reading = ResponseReading(events=5, events_at_usage=5, usage_last=cached_usage(40, 5, 32), final=True)
    facts = facts_of(200, reading, Api("chat"), ENC)
    full = settle_charge(40, facts)
    assert (full.prompt, full.completion, full.cached) == (40, 5, 32)
    tenth = settle_charge(40, facts, 0.1)  # 8 uncached + 32 x 0.1 = 11.2, charged 12
    assert (tenth.prompt, tenth.cached, tenth.total) == (12, 32, 17)
    free = settle_charge(40, facts, 0.0)
    assert (free.prompt, free.total) == (8, 13)
    half = settle_charge(40, facts, 0.5)
    assert half.prompt == 8 + 16


def test_a_cached_count_beyond_the_prompt_is_clamped_and_a_refusal_charges_nothing() -> None:
    reading = ResponseReading(events=1, events_at_usage=1, usage_last=cached_usage(10, 1, 99), final=True)
    charge = settle_charge(10, facts_of(200, reading, Api("chat"), ENC), 0.0)
    assert (charge.prompt, charge.cached) == (0, 10)
    busy = settle_charge(10, facts_of(503, reading, Api("chat"), ENC), 0.0)
    assert (busy.prompt, busy.completion, busy.cached) == (0, 0, 0)


def test_the_discount_is_never_more_than_the_weight_allows() -> None:
    """Rounded down, and safe from float error: 10 hits at 0.9 take exactly 1 token off, not 0."""
    assert cached_discount(10, 0.9) == 1 and cached_discount(10, 1.0) == 0 and cached_discount(0, 0.0) == 0
    for cached in range(0, 300, 7):
        for weight in (0.0, 0.1, 0.25, 1 / 3, 0.5, 0.9, 0.99):
            discount = cached_discount(cached, weight)
            assert 0 <= discount <= cached
            assert cached - discount >= cached * weight - 1e-6  # the charge covers the weighted hits
            assert cached - discount < cached * weight + 1  # and by less than one token more
