"""Token-in/token-out (vLLM), SGLang's native API, SageMaker /invocations and vLLM's batch chat."""

from __future__ import annotations

import json
from typing import Any

import pytest

from extproc.admission.apis import dialect_for
from extproc.admission.apis.common import UNNAMED_MODEL
from extproc.admission.intake.request import Api, BodyEdits
from extproc.admission.intake.reservation import Reservation
from extproc.admission.vocabulary.policy import MediaCosts, MissingMaxTokens, ModelPolicy, TemplateCosts
from extproc.config import DEFAULT_MODEL
from tests.unit.admission.apis_helpers import counts, edited, parse, plan, refused, sse, tk, track

G, S, E = Api("generate_tokens"), Api("sglang_generate"), Api("sglang_encode")
WINDOW = ModelPolicy(context_window=1000, template=TemplateCosts(0, 0))
MEDIA = ModelPolicy(
    1_000_000,
    template=TemplateCosts(0, 0),
    media=MediaCosts(image_tokens=100, audio_tokens_per_second=1, audio_seconds=30),
)


def test_an_unnamed_model_is_the_configured_default() -> None:
    assert UNNAMED_MODEL == DEFAULT_MODEL


# ------------------------------------------------------------------------------------------------------------
# /inference/v1/generate


def gen(**fields: Any) -> dict[str, Any]:
    return {"token_ids": [101, 2023, 2003, 102], "sampling_params": {"max_tokens": 20}, **fields}


def test_token_ids_are_the_prompt_and_max_tokens_bounds_each_sequence() -> None:
    req = parse(G, gen(sampling_params={"max_tokens": 20, "n": 3}))
    assert counts(req) == [4] and req.model == UNNAMED_MODEL and req.sequences == 3
    assert plan(G, gen(sampling_params={"max_tokens": 20, "n": 3}), WINDOW) == Reservation(4, 60)
    assert plan(G, gen(sampling_params={}), WINDOW) == Reservation(4, 996)  # absent: the rest of the window
    assert parse(G, gen(model="llama")).model == "llama"


def test_raw_media_parts_are_charged_features_are_already_in_the_ids() -> None:
    parts = [{"type": "image_url", "url": "https://x/a.png"}, {"type": "audio_url", "url": "https://x/a.wav"}]
    assert counts(parse(G, gen(content_parts=parts)), MEDIA) == [4 + 100 + 30]
    features = {"mm_hashes": {"image": ["h"]}, "mm_placeholders": {"image": [{"offset": 1, "length": 2}]}}
    assert counts(parse(G, gen(features=features)), MEDIA) == [4]


@pytest.mark.parametrize(
    ("fields", "code", "param"),
    [
        ({"token_ids": None}, "missing_field", "token_ids"),
        ({"token_ids": []}, "missing_field", "token_ids"),
        ({"token_ids": [1, -2]}, "invalid_value", "token_ids[1]"),
        ({"token_ids": [1, "a"]}, "invalid_type", "token_ids[1]"),
        ({"sampling_params": None}, "missing_field", "sampling_params"),
        ({"sampling_params": {"max_tokens": 0}}, "invalid_value", "sampling_params.max_tokens"),
        ({"sampling_params": {"n": 0}}, "invalid_value", "sampling_params.n"),
        ({"content_parts": [{"type": "image_url"}], "features": {}}, "invalid_value", "content_parts"),
        ({"stream": "no"}, "invalid_type", "stream"),
    ],
)
def test_generate_validation_names_the_field(fields: dict[str, Any], code: str, param: str) -> None:
    err = refused(G, gen(**fields))
    assert (err.code, err.param) == (code, param)


def test_generate_edits_ask_for_usage_write_the_bound_and_the_priority() -> None:
    out = edited(
        G,
        gen(stream=True, sampling_params={"n": 2}, priority=-1),
        BodyEdits(include_usage=True, max_tokens=64, priority=2),
    )
    assert out is not None
    assert out["stream_options"] == {"include_usage": True}
    assert out["sampling_params"] == {"n": 2, "max_tokens": 64} and out["priority"] == 2
    assert edited(G, gen(), BodyEdits(include_usage=True, max_tokens=64)) is None


def token_chunk(ids: list[int], index: int = 0) -> dict[str, Any]:
    return {"request_id": "r", "choices": [{"index": index, "token_ids": ids, "finish_reason": None}]}


def test_token_ids_are_counted_and_the_injected_usage_chunk_is_hidden() -> None:
    usage_chunk = {"request_id": "r", "choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 5}}
    body = sse((None, token_chunk([5, 6])), (None, token_chunk([7], 1)), (None, token_chunk([8, 9])))
    usage, tracker, out = track(G, body + sse((None, usage_chunk), (None, "[DONE]")), strip=True, step=9)
    assert (usage.prompt_tokens, usage.completion_tokens) == (4, 5) and tracker.done_seen
    assert out == body + b"data: [DONE]\n\n"
    usage, _, _ = track(G, body)  # no usage asked for: the ids are the count
    assert (usage.completion_tokens, usage.reported) == (5, False)
    text_mode = {"request_id": "r", "choices": [{"index": 0, "text": " hello world"}]}
    usage, _, _ = track(G, sse((None, text_mode)))
    assert usage.completion_tokens == tk(" hello world")


# ------------------------------------------------------------------------------------------------------------
# SGLang /generate and /encode


def test_sglang_batches_replicate_each_prompt_per_sample() -> None:
    req = parse(S, {"text": ["a b", "c"], "sampling_params": {"n": 3, "max_new_tokens": 10}})
    assert req.model == UNNAMED_MODEL and req.sequences == 1
    assert counts(req) == [tk("a b")] * 3 + [tk("c")] * 3
    assert plan(S, {"text": "hi", "sampling_params": {"n": 2}}, WINDOW) == Reservation(2 * tk("hi"), 2 * 128)


def test_sglang_output_bounds() -> None:
    assert parse(S, {"text": "x"}).requested_max_tokens == 128  # SGLang's default
    assert parse(S, {"text": "x", "sampling_params": {"max_new_tokens": 0}}).requested_max_tokens == 0
    assert parse(S, {"text": "x", "sampling_params": {"max_new_tokens": None}}).requested_max_tokens is None
    items: list[dict[str, Any]] = [{"max_new_tokens": 5}, {}, {"max_new_tokens": 300}]
    assert parse(S, {"text": ["a", "b", "c"], "sampling_params": items}).requested_max_tokens == 300
    items = [{"max_new_tokens": 5}, {"max_new_tokens": None}]
    assert parse(S, {"text": ["a", "b"], "sampling_params": items}).requested_max_tokens is None
    beams = parse(S, {"text": "x", "sampling_params": {"beam_width": 4, "n": 2}})
    assert (beams.sequences, len(beams.prompts)) == (4, 1)


def test_sglang_ids_embeddings_and_media() -> None:
    assert counts(parse(S, {"input_ids": [[1, 2, 3], [4]]})) == [3, 1]
    assert counts(parse(S, {"input_ids": [1, 2, 3]})) == [3]
    embeds = parse(S, {"input_embeds": [[[0.1, 0.2]], [[0.3, 0.4], [0.5, 0.6]]]})
    assert [p.opaque for p in embeds.prompts] == [True, True]
    assert [p.opaque for p in parse(S, {"input_embeds": [[0.1, 0.2], [0.3, 0.4]]}).prompts] == [True]
    # a batch's media list gives each request its own entry; a lone item is one image
    batch = parse(S, {"text": ["a", "b"], "image_data": [["u1", "u2"], "u3"]})
    assert counts(batch, MEDIA) == [tk("a") + 200, tk("b") + 100]
    assert counts(parse(S, {"text": "a", "image_data": ["u1", "u2"], "audio_data": "w"}), MEDIA) == [
        tk("a") + 230
    ]


@pytest.mark.parametrize(
    ("request_body", "code", "param"),
    [
        ({}, "missing_field", "text"),
        ({"text": "a", "input_ids": [1]}, "invalid_value", "input_ids"),
        ({"text": 3}, "invalid_type", "text"),
        ({"text": ["a", ["b"]]}, "invalid_type", "text[1]"),
        ({"input_ids": [[1], "x"]}, "invalid_type", "input_ids[1]"),
        ({"input_ids": [-1]}, "invalid_value", "input_ids[0]"),
        ({"text": "a", "sampling_params": "x"}, "invalid_type", "sampling_params"),
        (
            {"text": "a", "sampling_params": {"max_new_tokens": -1}},
            "invalid_value",
            "sampling_params.max_new_tokens",
        ),
        ({"text": ["a", "b"], "sampling_params": [{"n": 1}, {"n": 2}]}, "invalid_value", "sampling_params"),
        ({"text": "a", "stream": "yes"}, "invalid_type", "stream"),
        ({"text": "a", "session_params": {"id": "s"}}, "unsupported_parameter", "session_params"),
    ],
)
def test_sglang_validation_names_the_field(request_body: dict[str, Any], code: str, param: str) -> None:
    err = refused(S, request_body)
    assert (err.code, err.param) == (code, param)


def test_a_session_is_opaque_when_stored_context_is_allowed() -> None:
    req = parse(S, {"text": ["a", "b"], "session_params": {"id": "s"}}, allow_stored_context=True)
    assert req.stored_context == "session_params" and all(p.opaque for p in req.prompts)


def test_sglang_edits_fill_explicit_nulls_and_set_the_priority() -> None:
    items = [{"max_new_tokens": None}, {"max_new_tokens": 7}]
    out = edited(S, {"text": ["a", "b"], "sampling_params": items}, BodyEdits(max_tokens=50, priority=1))
    assert out is not None and out["sampling_params"] == [{"max_new_tokens": 50}, {"max_new_tokens": 7}]
    assert out["priority"] == 1
    assert edited(S, {"text": "a"}, BodyEdits(max_tokens=50, include_usage=True)) is None


def test_sglang_encode_takes_pairs_and_media_alone() -> None:
    req = parse(E, {"text": [["query", "doc one"], ["query", "doc two"]]})
    assert not req.generates and counts(req) == [tk("query", "doc one"), tk("query", "doc two")]
    assert counts(parse(E, {"image_data": ["u1", "u2"]}), MEDIA) == [200]
    assert refused(E, {}).param == "text"


def native(rid: str, prompt: int, completion: int | None, text: str = "") -> dict[str, Any]:
    meta: dict[str, Any] = {"id": rid, "prompt_tokens": prompt, "finish_reason": None}
    if completion is not None:
        meta["completion_tokens"] = completion
    return {"text": text, "meta_info": meta}


def test_sglang_streams_sum_the_cumulative_counts_of_every_request() -> None:
    chunks = [
        native("a", 5, 1, "x"),
        native("b", 5, 1, "y"),
        native("a", 5, 2, "x x"),
        native("b", 5, 3, "y y y"),
    ]
    body = sse(*((None, c) for c in chunks), (None, "[DONE]"))
    usage, tracker, _ = track(S, body, step=11)
    assert (usage.prompt_tokens, usage.completion_tokens, usage.reported) == (10, 5, True)
    assert tracker.done_seen
    error = {"error": {"message": "bad", "type": "invalid_request_error", "code": 400}}
    _, tracker, _ = track(S, sse((None, chunks[0]), (None, error), (None, "[DONE]")))
    assert tracker.error_seen


def test_sglang_bodies_one_result_or_a_batch() -> None:
    usage, _, _ = track(S, json.dumps(native("a", 7, 4)).encode(), streaming=False)
    assert (usage.prompt_tokens, usage.completion_tokens) == (7, 4)
    batch = [native("a", 7, 4), native("b", 3, 2)]
    usage, _, _ = track(S, json.dumps(batch).encode(), streaming=False)
    assert (usage.prompt_tokens, usage.completion_tokens) == (10, 6)
    usage, _, _ = track(E, json.dumps([native("a", 7, None)]).encode(), streaming=False)
    assert (usage.prompt_tokens, usage.completion_tokens) == (7, 0)


def test_each_response_gets_its_own_sglang_reader() -> None:
    assert dialect_for(S) is not dialect_for(S)
    assert dialect_for(Api("chat")) is dialect_for(Api("chat"))


# ------------------------------------------------------------------------------------------------------------
# /invocations


@pytest.mark.parametrize(
    ("request_body", "api"),
    [
        ({"model": "m", "messages": [{"role": "user", "content": "hi"}]}, Api("chat")),
        ({"model": "m", "prompt": "hi"}, Api("completions")),
        ({"model": "m", "prompt_embeds": "AAAA"}, Api("completions")),
        ({"model": "m", "input": ["a", "b"]}, Api("embeddings")),
        ({"query": "q", "documents": ["a", "b"]}, Api("score")),
        ({"text_1": "q", "text_2": ["a", "b"]}, Api("score")),
        ({"data": {"image": "x"}}, Api("pooling")),
    ],
)
def test_invocations_resolve_by_shape_in_vllms_order(request_body: dict[str, Any], api: Api) -> None:
    req = parse(Api("invocations"), request_body)
    assert req.api == api
    assert dialect_for(req.api) is not None


def test_invocations_are_edited_as_the_api_they_resolved_to() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    out = edited(Api("invocations"), body, BodyEdits(include_usage=True))
    assert out is not None and out["stream_options"] == {"include_usage": True}


def test_an_unknown_shape_is_refused() -> None:
    err = refused(Api("invocations"), {"model": "m", "foo": 1})
    assert "handler" in err.message


def test_missing_max_tokens_on_invocations_follows_the_resolved_api() -> None:
    policy = ModelPolicy(1000, template=TemplateCosts(0, 0), missing_max_tokens=MissingMaxTokens.INJECT)
    got = plan(Api("invocations"), {"model": "m", "messages": [{"role": "user", "content": "hi"}]}, policy)
    assert got.injected_max_tokens == 1000 - tk("user", "hi")


# ------------------------------------------------------------------------------------------------------------
# /v1/chat/completions/batch


def test_batch_chat_is_one_prompt_per_conversation() -> None:
    conversations = [
        [{"role": "user", "content": "one"}],
        [{"role": "system", "content": "s"}, {"role": "user", "content": "two"}],
    ]
    req = parse(
        Api("chat_batch"),
        {"model": "m", "messages": conversations, "max_completion_tokens": 9, "tools": [{"x": 1}]},
    )
    # vLLM builds each conversation's chat request from every other field, extra ones included: the tools
    # are rendered into each conversation.
    tools = tk('[{"x":1}]')
    assert counts(req) == [tk("user", "one") + tools, tk("system", "s", "user", "two") + tools]
    assert (req.requested_max_tokens, req.max_tokens_param, req.sequences) == (9, "max_completion_tokens", 1)
    assert (
        plan(
            Api("chat_batch"), {"model": "m", "messages": conversations, "max_tokens": 9}, WINDOW
        ).completion_tokens
        == 18
    )


@pytest.mark.parametrize(
    ("fields", "code", "param"),
    [
        ({"messages": None}, "missing_field", "messages"),
        ({"messages": []}, "invalid_type", "messages"),
        ({"messages": [[]]}, "invalid_value", "messages[0]"),
        (
            {"messages": [[{"role": "user", "content": "a"}], [{"role": "user"}]]},
            "missing_field",
            "messages[1][0].content",
        ),
        ({"n": 2}, "invalid_value", "n"),
    ],
)
def test_batch_chat_validation_names_the_field(fields: dict[str, Any], code: str, param: str) -> None:
    err = refused(
        Api("chat_batch"), {"model": "m", "messages": [[{"role": "user", "content": "a"}]], **fields}
    )
    assert (err.code, err.param) == (code, param)


def test_batch_chat_edits() -> None:
    out = edited(
        Api("chat_batch"),
        {"model": "m", "messages": [[{"role": "user", "content": "a"}]]},
        BodyEdits(max_tokens=12, strip_priority=True),
    )
    assert out is not None and out["max_tokens"] == 12


@pytest.mark.parametrize(
    "request_body",
    [
        # vLLM falls through to the next type when one fails: a chat body it rejects on a field the gateway
        # does not check would run as a completion of `prompt`
        {"model": "m", "messages": [{"role": "user", "content": "x"}], "prompt": "y" * 100, "logprobs": 5},
        {"model": "m", "messages": [{"role": "user", "content": "x"}], "input": "y"},
        {"model": "m", "prompt": "x", "query": "q", "documents": ["d"]},
    ],
)
def test_a_body_with_the_fields_of_two_apis_is_refused(request_body: dict[str, Any]) -> None:
    err = refused(Api("invocations"), request_body)
    assert err.code == "invalid_value" and "ambiguous" in err.message


def test_sglang_chat_input_ids_are_counted_on_top_of_the_messages() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "input_ids": list(range(500))}
    assert counts(parse(Api("chat"), body)) == [tk("user", "x") + 500]
    assert refused(Api("chat"), {**body, "input_ids": [1, -1]}).param == "input_ids[1]"
