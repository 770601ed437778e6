"""Cohere's /v2/embed (extproc/admission/apis/cohere_embed.py): inputs are prompts, billed units the usage."""

from __future__ import annotations

import json
from typing import Any

import pytest

from extproc.admission.intake.request import Api
from extproc.admission.vocabulary.policy import MediaCosts, ModelPolicy, TemplateCosts
from tests.unit.admission.apis_helpers import counts, parse, refused, track
from tests.unit.admission.apis_helpers import tk as tokens

C = Api("cohere_embed")
MEDIA = ModelPolicy(1_000_000, template=TemplateCosts(0, 0), media=MediaCosts(image_tokens=100))


def test_cohere_embed_inputs() -> None:
    assert counts(parse(C, {"model": "m", "texts": ["a", "b c"]})) == [tokens("a"), tokens("b c")]
    assert counts(parse(C, {"images": ["data:image/png;base64,AA"]}), MEDIA) == [100]
    inputs = [
        {"content": [{"type": "text", "text": "caption"}, {"type": "image_url", "image_url": {"url": "u"}}]}
    ]
    assert counts(parse(C, {"inputs": inputs}), MEDIA) == [tokens("caption") + 100]


@pytest.mark.parametrize(
    ("request_body", "param"),
    [
        ({"texts": ["a"], "images": ["b"]}, None),
        ({}, None),
        ({"texts": []}, "texts"),
        ({"texts": [3]}, "texts[0]"),
        ({"inputs": [{"content": [{"type": "audio", "x": 1}]}]}, "inputs[0].content[0].type"),
        ({"inputs": [{}]}, "inputs[0].content"),
    ],
)
def test_cohere_validation(request_body: dict[str, Any], param: str | None) -> None:
    assert refused(C, request_body).param == param


def test_cohere_billed_units_are_the_prompt() -> None:
    answer = {
        "id": "e",
        "embeddings": {"float": [[0.1]]},
        "meta": {"billed_units": {"input_tokens": 9, "image_tokens": 30}},
    }
    usage, _, _ = track(C, json.dumps(answer).encode(), streaming=False)
    assert (usage.prompt_tokens, usage.completion_tokens, usage.reported) == (39, 0, True)
    usage, _, _ = track(C, json.dumps({**answer, "meta": None}).encode(), streaming=False)
    assert (usage.prompt_tokens, usage.reported) == (None, False)
