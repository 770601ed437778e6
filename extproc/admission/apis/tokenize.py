"""`/tokenize` renders and tokenizes, fetching and processing media for chat messages: no model runs, but
the work grows with the prompt, so it is metered as a prompt; its answer states the count.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from extproc.admission.apis.common import drop_priority, optional_model
from extproc.admission.apis.openai import OPENAI_SPEC, chat_prompt, text_prompts
from extproc.admission.apis.pooling import pooled
from extproc.admission.apis.spec import SGLANG, ApiSpec, path, shared
from extproc.admission.vocabulary.parsed import Api, BodyEdits, ParsedRequest
from extproc.admission.vocabulary.usage import Observed, count_int


class TokenizeAdapter:
    """`/tokenize`: a `prompt` (a string; SGLang also takes a list) or chat `messages` with `tools` (vLLM
    v0.33.0 entrypoints/serve/tokenize/protocol.py:23-60; SGLang v0.5.23 openai/protocol.py:1744-1752)."""

    api = Api("tokenize")

    def parse(self, body: dict[str, Any]) -> ParsedRequest:
        model = optional_model(body)
        if body.get("messages") is not None:
            return pooled(self.api, body, (chat_prompt(body),), "messages", model)
        return pooled(self.api, body, text_prompts(body, "prompt"), "prompt", model)

    def edit(self, req: ParsedRequest, body: dict[str, Any], edits: BodyEdits) -> bool:
        return drop_priority(body, edits)


class TokenizeDialect:
    """A `/tokenize` answer states its own token count, `count` (vLLM v0.33.0
    entrypoints/serve/tokenize/protocol.py `TokenizeResponse`): that is the prompt charged."""

    def event(self, name: bytes, obj: Mapping[str, Any]) -> Observed:
        return self.body(obj)

    def body(self, obj: Any) -> Observed:
        if not isinstance(obj, dict):
            return Observed()
        seen = Observed.of_body(obj)
        found = obj.get("count")
        counts = found if isinstance(found, list) else [found]
        values = [count_int(c) for c in counts]
        if counts and all(v is not None for v in values):
            seen.usage_seen = True
            seen.prompt = sum(v for v in values if v is not None)
            seen.completion = 0
        return seen


TOKENIZE_DIALECT = TokenizeDialect()

SPEC = ApiSpec(
    adapter=TokenizeAdapter(),
    dialect=shared(TOKENIZE_DIALECT),
    read=OPENAI_SPEC,  # one JSON body, read whole by the dialect
    paths=(
        path("/tokenize", "renders the chat template and processes media; no model runs"),
        path("/v1/tokenize", "tokenizes; no model runs", SGLANG),
    ),
)
