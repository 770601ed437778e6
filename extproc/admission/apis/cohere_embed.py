"""Cohere's embed schema on vLLM, `POST /v2/embed`: one prompt per text, image or input, nothing generated.

The whole API in one module: its adapter (exactly one of `texts`, `images`, `inputs`), its dialect (usage
in `meta.billed_units`) and its `ApiSpec` (vLLM v0.33.0 entrypoints/pooling/embed/protocol.py:208-269).
vLLM's `padding: "max_length"` charges every prompt the whole window (see `common.padded`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from extproc.admission.apis.common import optional_model
from extproc.admission.apis.openai import OPENAI_SPEC, ContentTexts, edit_priority
from extproc.admission.apis.pooling import IMAGE, pooled
from extproc.admission.apis.spec import PROMPT_ONLY, VLLM, ApiSpec, path, shared
from extproc.admission.vocabulary import fields as f
from extproc.admission.vocabulary.parsed import Api, BodyEdits, ParsedRequest
from extproc.admission.vocabulary.prompt import Prompt
from extproc.admission.vocabulary.usage import Observed, count_int


def _cohere_input(value: Any, param: str) -> Prompt:
    if not isinstance(value, dict):
        f.bad(f"'{param}' must be an object.", code="invalid_type", param=param)
    content = f.opt_list(value, "content", f"{param}.content")
    if content is None:
        f.bad(
            f"Missing required parameter: '{param}.content'.", code="missing_field", param=f"{param}.content"
        )
    parts = ContentTexts()
    for j, part in enumerate(content):
        where = f"{param}.content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("text", "image_url"):
            # vLLM v0.33.0 entrypoints/pooling/embed/protocol.py:208-223
            f.bad(
                f"'{where}.type' must be 'text' or 'image_url'.", code="invalid_value", param=f"{where}.type"
            )
        parts.add_part(part, where)
    return Prompt(texts=tuple(parts.texts), media=parts.media)


class CohereEmbedAdapter:
    """`/v2/embed`: exactly one of `texts`, `images`, `inputs`, non-empty (vLLM v0.33.0
    entrypoints/pooling/embed/protocol.py:229-251)."""

    api = Api("cohere_embed")

    def parse(self, body: dict[str, Any]) -> ParsedRequest:
        model = optional_model(body)
        given = [key for key in ("texts", "images", "inputs") if body.get(key) is not None]
        values = f.opt_list(body, given[0], given[0]) if len(given) == 1 else None
        if not values:
            f.bad(
                "Exactly one of texts, images, or inputs must be provided, and it must be non-empty.",
                code="invalid_value",
                param=given[0] if len(given) == 1 else None,
            )
        key = given[0]
        prompts: list[Prompt] = []
        for i, value in enumerate(values):
            where = f"{key}[{i}]"
            if key == "inputs":
                prompts.append(_cohere_input(value, where))
            elif not isinstance(value, str):
                f.bad(f"'{where}' must be a string.", code="invalid_type", param=where)
            else:
                prompts.append(Prompt(texts=(value,)) if key == "texts" else Prompt(media=IMAGE))
        return pooled(self.api, body, tuple(prompts), key, model)

    def edit(self, req: ParsedRequest, body: dict[str, Any], edits: BodyEdits) -> bool:
        return edit_priority(body, edits)


class CohereDialect:
    """Cohere embed bodies report the prompt as `meta.billed_units.{input_tokens,image_tokens}` (vLLM
    v0.33.0 entrypoints/pooling/embed/protocol.py:262-269)."""

    def event(self, name: bytes, obj: Mapping[str, Any]) -> Observed:
        return self.body(obj)

    def body(self, obj: Any) -> Observed:
        if not isinstance(obj, dict):
            return Observed()
        seen = Observed.of_body(obj)
        meta = obj.get("meta")
        billed = meta.get("billed_units") if isinstance(meta, dict) else None
        if isinstance(billed, dict):
            text, images = count_int(billed.get("input_tokens")), count_int(billed.get("image_tokens"))
            if text is not None or images is not None:
                seen.usage_seen = True
                seen.prompt = (text or 0) + (images or 0)
                seen.completion = 0
        return seen


COHERE_DIALECT = CohereDialect()


SPEC = ApiSpec(
    adapter=CohereEmbedAdapter(),
    dialect=shared(COHERE_DIALECT),
    read=OPENAI_SPEC,  # one JSON body, read whole by the dialect
    paths=(path("/v2/embed", PROMPT_ONLY + " (Cohere schema)", VLLM),),
)
