"""Pooling, score, rerank and tokenizer APIs: prompt tokens only."""

from __future__ import annotations

import json
from typing import Any

import pytest

from extproc.admission.intake.request import Api, BodyEdits
from extproc.admission.intake.reservation import Reservation
from extproc.admission.vocabulary.errors import AdmissionError
from extproc.admission.vocabulary.policy import MediaCosts, ModelPolicy, TemplateCosts
from tests.unit.admission.apis_helpers import counts, edited, parse, plan, refused, track
from tests.unit.admission.apis_helpers import tk as tokens

P, SC = Api("pooling"), Api("score")
BARE_T = ModelPolicy(1_000_000, template=TemplateCosts(0, 0))
MEDIA = ModelPolicy(1_000_000, template=TemplateCosts(0, 0), media=MediaCosts(image_tokens=100))


# ------------------------------------------------------------------------------------------------------------
# /pooling, /classify


def test_pooling_shapes() -> None:
    req = parse(P, {"input": ["alpha", "beta gamma"]})
    assert not req.generates and counts(req) == [tokens("alpha"), tokens("beta gamma")]
    chat = parse(P, {"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert chat.prompt_param == "messages" and counts(chat) == [tokens("user", "hi")]
    plugin = parse(P, {"data": {"url": "s3://tile"}})
    assert plugin.prompt_param == "data" and plugin.prompts[0].opaque
    for api in (P, Api("embeddings")):
        both = {"model": "m", "input": "a", "messages": [{"role": "user", "content": "b"}]}
        assert refused(api, both).param == "messages"
    assert plan(P, {"data": {"url": "s3://tile"}}, ModelPolicy(512)) == Reservation(512, 0)


def test_sglang_native_classify_is_an_encode_request() -> None:
    req = parse(P, {"text": ["a", "b"]})
    assert req.api == Api("sglang_encode") and counts(req) == [tokens("a"), tokens("b")]


def test_padding_to_max_length_charges_the_window_per_prompt() -> None:
    policy = ModelPolicy(context_window=300)
    assert plan(P, {"input": ["a", "b"], "padding": "max_length"}, policy) == Reservation(600, 0)
    assert plan(
        Api("embeddings"), {"model": "m", "input": "a", "padding": "max_length"}, policy
    ) == Reservation(300, 0)
    assert plan(P, {"input": "a", "padding": "do_not_pad"}, policy) == Reservation(tokens("a"), 0)
    err = refused(P, {"input": "a", "padding": "longest"})
    assert (err.code, err.param) == ("invalid_value", "padding")


def test_a_pooling_prompt_larger_than_the_window_is_refused() -> None:
    with pytest.raises(AdmissionError) as info:
        plan(P, {"input": "word " * 50}, ModelPolicy(context_window=20))
    assert (info.value.code, info.value.param) == ("context_length_exceeded", "input")


# ------------------------------------------------------------------------------------------------------------
# score and rerank


def test_one_query_is_replicated_into_every_pair() -> None:
    req = parse(
        SC, {"model": "m", "query": "what is kv cache", "documents": ["a cache", "of keys", "and values"]}
    )
    q = tokens("what is kv cache")
    assert counts(req, BARE_T) == [q + tokens("a cache"), q + tokens("of keys"), q + tokens("and values")]
    assert req.prompts[0].templated and req.prompt_param == "query"


@pytest.mark.parametrize(
    "shape",
    [
        {"queries": ["q1", "q2"], "documents": ["d1", "d2"]},
        {"queries": ["q1", "q2"], "items": ["d1", "d2"]},
        {"data_1": ["q1", "q2"], "data_2": ["d1", "d2"]},
        {"text_1": ["q1", "q2"], "text_2": ["d1", "d2"]},
    ],
)
def test_n_to_n_scores_pair_in_order(shape: dict[str, Any]) -> None:
    assert counts(parse(SC, shape), BARE_T) == [tokens("q1", "d1"), tokens("q2", "d2")]


def test_token_ids_multimodal_content_and_instructions() -> None:
    sglang = parse(SC, {"query": [1, 2, 3], "items": [[4, 5], [6]]})
    assert counts(sglang, BARE_T) == [5, 4]
    image = {"type": "image_url", "image_url": {"url": "https://x/a.png"}}
    vllm = {"queries": "find the cat", "documents": [{"content": [image, {"type": "text", "text": "a cat"}]}]}
    assert counts(parse(SC, vllm), MEDIA) == [tokens("find the cat", "a cat") + 100]
    sglang_parts = {"query": "q", "documents": [[image], "plain"], "instruct": "Judge relevance."}
    assert counts(parse(SC, sglang_parts), MEDIA) == [
        tokens("Judge relevance.", "q") + 100,
        tokens("Judge relevance.", "q", "plain"),
    ]


@pytest.mark.parametrize(
    ("shape", "code", "param"),
    [
        ({"query": "q"}, "missing_field", None),
        ({"queries": ["a", "b"], "documents": ["x", "y", "z"]}, "invalid_value", "documents"),
        ({"query": "q", "documents": []}, "invalid_value", "documents"),
        ({"query": 5, "documents": ["a"]}, "invalid_type", "query"),
        ({"query": "q", "documents": [{"content": "x"}]}, "invalid_type", "documents[0].content"),
        ({"query": "q", "items": [[1, -1]]}, "invalid_value", "items[0][1]"),
        ({"query": "q", "queries": ["p"], "documents": ["d"]}, "invalid_value", "queries"),
        ({"text_1": "a", "text_2": "b", "data_1": "c", "data_2": "d"}, "invalid_value", "text_1"),
    ],
)
def test_score_validation(shape: dict[str, Any], code: str, param: str | None) -> None:
    err = refused(SC, shape)
    assert (err.code, err.param) == (code, param)


def test_pooling_edits_set_or_strip_the_priority() -> None:
    out = edited(SC, {"query": "q", "documents": ["a"], "priority": 9}, BodyEdits(strip_priority=True))
    assert out is not None and "priority" not in out
    out = edited(
        P, {"input": "a"}, BodyEdits(strip_priority=True, priority=2, include_usage=True, max_tokens=5)
    )
    assert out == {"input": "a", "priority": 2}


def test_rerank_and_score_bodies_report_prompt_tokens() -> None:
    rerank = {"id": "r", "model": "m", "usage": {"prompt_tokens": 42, "total_tokens": 42}, "results": []}
    usage, _, _ = track(SC, json.dumps(rerank).encode(), streaming=False)
    assert (usage.prompt_tokens, usage.completion_tokens, usage.reported) == (42, 0, True)


# ------------------------------------------------------------------------------------------------------------
# /tokenize, /detokenize


def test_tokenize_and_detokenize() -> None:
    assert counts(parse(Api("tokenize"), {"prompt": "hello world"})) == [tokens("hello world")]
    assert counts(parse(Api("tokenize"), {"prompt": ["a", "b"]})) == [tokens("a"), tokens("b")]
    chat = parse(Api("tokenize"), {"messages": [{"role": "user", "content": "hi"}], "tools": [{"a": 1}]})
    assert counts(chat) == [tokens("user", "hi", '[{"a":1}]')]
    assert counts(parse(Api("detokenize"), {"tokens": [1, 2, 3]})) == [3]
    assert counts(parse(Api("detokenize"), {"tokens": [[1, 2], [3]]})) == [2, 1]
    assert refused(Api("tokenize"), {}).param == "prompt"
    assert refused(Api("detokenize"), {"tokens": [1, "x"]}).param == "tokens[1]"
    assert refused(Api("detokenize"), {}).param == "tokens"
    out = edited(Api("tokenize"), {"prompt": "a", "priority": 1}, BodyEdits(strip_priority=True, priority=3))
    assert out == {"prompt": "a"}  # no priority field to set


def test_tokenize_reports_its_own_count() -> None:
    usage, _, _ = track(
        Api("tokenize"),
        json.dumps({"count": 7, "max_model_len": 8192, "tokens": [1] * 7}).encode(),
        streaming=False,
    )
    assert (usage.prompt_tokens, usage.completion_tokens) == (7, 0)
    usage, _, _ = track(Api("tokenize"), json.dumps({"count": [2, 3]}).encode(), streaming=False)
    assert usage.prompt_tokens == 5
