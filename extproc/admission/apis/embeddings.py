"""OpenAI's embeddings, `POST /v1/embeddings`: prompt tokens only, nothing generated."""

from __future__ import annotations

from typing import Any

from extproc.admission.apis.common import padded
from extproc.admission.apis.openai import (
    OPENAI_DIALECT,
    OPENAI_SPEC,
    chat_prompt,
    edit_priority,
    text_prompts,
)
from extproc.admission.apis.spec import PROMPT_ONLY, ApiSpec, path, shared
from extproc.admission.vocabulary import fields as f
from extproc.admission.vocabulary.parsed import Api, BodyEdits, ParsedRequest
from extproc.admission.vocabulary.prompt import Prompt


class EmbeddingsAdapter:
    """Embeddings (and vLLM's chat-style embeddings with `messages`): prompt tokens only; vLLM's
    `padding: "max_length"` charges each prompt the whole window."""

    api = Api("embeddings")

    def parse(self, body: dict[str, Any]) -> ParsedRequest:
        model = f.model_name(body)
        if body.get("messages") is not None and body.get("input") is not None:
            # Two shapes in one body: which one the server validates first is not the gateway's to guess.
            f.bad("Send either 'input' or 'messages', not both.", code="invalid_value", param="messages")
        if body.get("messages") is not None:
            found: tuple[Prompt, ...] = (chat_prompt(body),)
            param = "messages"
        else:
            found, param = text_prompts(body, "input"), "input"
        return ParsedRequest(
            api=self.api,
            model=model,
            prompts=padded(body, found),
            prompt_param=param,
            generates=False,
            truncate_prompt_tokens=f.truncation(body),
            body=body,
        )

    def edit(self, req: ParsedRequest, body: dict[str, Any], edits: BodyEdits) -> bool:
        return edit_priority(body, edits)


SPEC = ApiSpec(
    adapter=EmbeddingsAdapter(),
    dialect=shared(OPENAI_DIALECT),
    read=OPENAI_SPEC,
    paths=(path("/v1/embeddings", PROMPT_ONLY),),
)
