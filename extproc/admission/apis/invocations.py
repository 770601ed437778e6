"""SageMaker's `POST /invocations`: one path for every API, the API chosen by the body's shape.

vLLM validates the body against each request type in order and serves the first that fits: chat
completions, completions, then embeddings, classification, rerank, score and pooling (vLLM v0.33.0
entrypoints/serve/sagemaker/api_router.py:79-136, generate/factories.py:16-42,
pooling/factories.py:236-286). The gateway follows the same order on the field each type requires and parses
with that API's adapter, so the request is metered, edited and settled as that API. SGLang's `/invocations`
takes chat completions only (SGLang v0.5.23 srt/entrypoints/http_server.py:2202-2212), which this order
resolves the same way.
"""

from __future__ import annotations

from typing import Any

from extproc.admission.apis.chat import ChatAdapter
from extproc.admission.apis.completions import CompletionsAdapter
from extproc.admission.apis.embeddings import EmbeddingsAdapter
from extproc.admission.apis.openai import OPENAI_DIALECT, OPENAI_SPEC
from extproc.admission.apis.pooling import PoolingAdapter
from extproc.admission.apis.score import SCORE_SHAPES, ScoreAdapter
from extproc.admission.apis.spec import ApiSpec, path, shared
from extproc.admission.vocabulary import fields as f
from extproc.admission.vocabulary.parsed import Adapter, Api, BodyEdits, ParsedRequest

ORDER: tuple[tuple[tuple[str, ...], Adapter], ...] = (
    (("messages",), ChatAdapter()),
    (("prompt", "prompt_embeds"), CompletionsAdapter()),
    (("input",), EmbeddingsAdapter()),  # embeddings and classification share this shape
    (tuple(key for pair in SCORE_SHAPES for key in pair), ScoreAdapter()),
    (("data",), PoolingAdapter()),  # an IO-processor plugin request
)
"""(fields any of which selects the API, its adapter), in vLLM's order."""


def resolve(body: dict[str, Any]) -> Adapter:
    """The adapter of the first API whose required field the body has (see the module docstring).

    A body with the fields of two APIs is refused: the backend falls through to the next type when a body
    fails one type's validation, so a chat body that vLLM rejects on a field the gateway does not check
    would run as a completion of its `prompt`, which the gateway never counted.
    """
    found = [(keys, adapter) for keys, adapter in ORDER if any(body.get(key) is not None for key in keys)]
    if not found:
        f.bad(
            "Cannot find a suitable handler for the request: expected a chat (messages), completion "
            "(prompt), embedding or classification (input), score or rerank (query and documents), or "
            "pooling (data) body.",
            code="invalid_value",
            param=None,
        )
    if len(found) > 1:
        fields = [next(key for key in keys if body.get(key) is not None) for keys, _ in found]
        f.bad(
            f"The request is ambiguous: it carries the fields of several APIs ({', '.join(fields)}). Send "
            "the fields of one.",
            code="invalid_value",
            param=fields[1],
        )
    return found[0][1]


class InvocationsAdapter:
    api = Api("invocations")

    def parse(self, body: dict[str, Any]) -> ParsedRequest:
        return resolve(body).parse(body)

    def edit(self, req: ParsedRequest, body: dict[str, Any], edits: BodyEdits) -> bool:
        """A parsed request names the API it resolved to, whose adapter edits it."""
        for _, adapter in ORDER:
            if adapter.api == req.api:
                return adapter.edit(req, body, edits)
        return False


SPEC = ApiSpec(
    adapter=InvocationsAdapter(),
    # A parsed /invocations request names the API it resolved to, whose spec reads its response and renders
    # its refusals; this API's own dialect and read spec are never used.
    dialect=shared(OPENAI_DIALECT),
    read=OPENAI_SPEC,
    paths=(path("/invocations", "generates or pools: the API is chosen by the body's shape"),),
)
