"""Score and rerank (`/score`, `/v1/score`, `/rerank`, `/v1/rerank`, `/v2/rerank`): one prompt per (query,
document) pair, nothing generated; a single query is replicated into every pair (vLLM v0.33.0
entrypoints/pooling/scoring/io_processor.py:541-545), so N documents cost N x (query + document).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from extproc.admission.apis.common import optional_model
from extproc.admission.apis.openai import OPENAI_DIALECT, OPENAI_SPEC, ContentTexts, edit_priority
from extproc.admission.apis.pooling import pooled
from extproc.admission.apis.spec import BOTH, VLLM, ApiSpec, path, shared
from extproc.admission.vocabulary import fields as f
from extproc.admission.vocabulary.parsed import Api, BodyEdits, ParsedRequest
from extproc.admission.vocabulary.prompt import Prompt

SCORE_SHAPES = (
    ("query", "documents"),  # rerank (vLLM, SGLang)
    ("queries", "documents"),  # vLLM score
    ("queries", "items"),
    ("data_1", "data_2"),
    ("text_1", "text_2"),
    ("query", "items"),  # SGLang /v1/score
)
"""The (queries, documents) field pairs of the score and rerank schemas (vLLM v0.33.0
entrypoints/pooling/scoring/protocol.py:81-136; SGLang v0.5.23 srt/entrypoints/openai/protocol.py:1482-1488,
1687-1697)."""


def _element(value: Any, param: str) -> Prompt:
    """One query or document: a string, token ids, `{"content": [parts]}`, or a list of content parts."""
    if isinstance(value, str):
        return Prompt(texts=(value,))
    if isinstance(value, dict):
        value = value.get("content")
        param = f"{param}.content"
        if not isinstance(value, list):
            f.bad(f"'{param}' must be an array of content parts.", code="invalid_type", param=param)
    if not isinstance(value, list) or not value:
        f.bad(
            f"'{param}' must be a string, token ids or content parts, got {f.json_type(value)}.",
            code="invalid_type",
            param=param,
        )
    if all(type(v) is int for v in value):
        f.token_ids(value, param)
        return Prompt(fixed_tokens=len(value))
    parts = ContentTexts()
    for j, part in enumerate(value):
        parts.add_part(part, f"{param}[{j}]")
    return Prompt(texts=tuple(parts.texts), media=parts.media)


def _side(value: Any, param: str, single: bool) -> list[Prompt]:
    """The elements of one side: `single` sides hold one element, others one or a list of elements."""
    if value is None:
        f.bad(f"Missing required parameter: '{param}'.", code="missing_field", param=param)
    if isinstance(value, list) and not value:
        f.bad(f"'{param}' must not be empty.", code="invalid_value", param=param)
    if single or not isinstance(value, list) or all(type(v) is int for v in value):
        return [_element(value, param)]
    return [_element(v, f"{param}[{i}]") for i, v in enumerate(value)]


def _join(query: Prompt, document: Prompt, instruction: tuple[str, ...]) -> Prompt:
    return Prompt(
        texts=instruction + query.texts + document.texts,
        fixed_tokens=query.fixed_tokens + document.fixed_tokens,
        templated=True,
        media=query.media + document.media,
    )


def score_pairs(body: Mapping[str, Any]) -> tuple[tuple[Prompt, ...], str]:
    """One prompt per pair, and the field the queries came from; lengths must be 1:1, 1:N or N:N (vLLM
    v0.33.0 entrypoints/pooling/scoring/utils.py:111-123)."""
    shapes = [(a, b) for a, b in SCORE_SHAPES if body.get(a) is not None and body.get(b) is not None]
    if not shapes:
        f.bad(
            "Expected a query and documents: one of "
            + ", ".join(f"'{a}' with '{b}'" for a, b in SCORE_SHAPES)
            + ".",
            code="missing_field",
            param=None,
        )
    if len(shapes) > 1:
        # The server's schema is a union: which shape it takes is not the gateway's to guess.
        f.bad(
            "Send one query and documents shape, got "
            + ", ".join(f"'{a}' with '{b}'" for a, b in shapes)
            + ".",
            code="invalid_value",
            param=shapes[1][0],
        )
    first, second = shapes[0]
    queries = _side(body[first], first, single=first == "query")
    documents = _side(body[second], second, single=False)
    if len(queries) not in (1, len(documents)):
        f.bad("Input lengths must be either 1:1, 1:N or N:N.", code="invalid_value", param=second)
    instruction = tuple(
        value for key in ("instruction", "instruct") if isinstance(value := body.get(key), str)
    )
    if len(queries) == 1:
        queries = queries * len(documents)
    return tuple(_join(q, d, instruction) for q, d in zip(queries, documents, strict=True)), first


class ScoreAdapter:
    api = Api("score")

    def parse(self, body: dict[str, Any]) -> ParsedRequest:
        model = optional_model(body)
        pairs, param = score_pairs(body)
        return pooled(self.api, body, pairs, param, model)

    def edit(self, req: ParsedRequest, body: dict[str, Any], edits: BodyEdits) -> bool:
        return edit_priority(body, edits)


PAIRS = "runs the model on each (query, document) pair"

SPEC = ApiSpec(
    adapter=ScoreAdapter(),
    dialect=shared(OPENAI_DIALECT),
    read=OPENAI_SPEC,  # one JSON body, read whole by the dialect
    paths=(
        path("/score", PAIRS, VLLM),
        path("/v1/score", "runs the model on each (query, item) pair"),
        path("/rerank", PAIRS, VLLM),
        path("/v1/rerank", PAIRS, BOTH, ("POST", "PUT")),
        path("/v2/rerank", PAIRS, VLLM),
    ),
)
