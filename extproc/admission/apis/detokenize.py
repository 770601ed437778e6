"""`/detokenize` decodes token ids: no model runs, but the work grows with the ids, so each id is metered
as a prompt token.
"""

from __future__ import annotations

from typing import Any

from extproc.admission.apis.common import drop_priority, optional_model
from extproc.admission.apis.openai import OPENAI_DIALECT, OPENAI_SPEC
from extproc.admission.apis.pooling import pooled
from extproc.admission.apis.spec import SGLANG, ApiSpec, path, shared
from extproc.admission.vocabulary import fields as f
from extproc.admission.vocabulary.parsed import Api, BodyEdits, ParsedRequest
from extproc.admission.vocabulary.prompt import Prompt


class DetokenizeAdapter:
    """`/detokenize`: `tokens`, token ids (SGLang also takes a list of them); each id is a token."""

    api = Api("detokenize")

    def parse(self, body: dict[str, Any]) -> ParsedRequest:
        model = optional_model(body)
        tokens = f.opt_list(body, "tokens", "tokens")
        if tokens is None:
            f.bad("Missing required parameter: 'tokens'.", code="missing_field", param="tokens")
        if tokens and all(isinstance(t, list) for t in tokens):
            for i, ids in enumerate(tokens):
                f.token_ids(ids, f"tokens[{i}]")
            prompts = tuple(Prompt(fixed_tokens=len(ids)) for ids in tokens)
        else:
            f.token_ids(tokens, "tokens")
            prompts = (Prompt(fixed_tokens=len(tokens)),)
        return pooled(self.api, body, prompts, "tokens", model)

    def edit(self, req: ParsedRequest, body: dict[str, Any], edits: BodyEdits) -> bool:
        return drop_priority(body, edits)


NO_MODEL = "decodes token ids; no model runs"

SPEC = ApiSpec(
    adapter=DetokenizeAdapter(),
    dialect=shared(OPENAI_DIALECT),
    read=OPENAI_SPEC,  # one JSON body, read whole by the dialect
    paths=(path("/detokenize", NO_MODEL), path("/v1/detokenize", NO_MODEL, SGLANG)),
)
