"""Pooling APIs that use OpenAI's input shapes: prompt tokens only, nothing is generated.

`/pooling`, `/classify` (vLLM), `/v1/classify` (SGLang): `input` (string, strings, token ids) or chat
`messages`, one prompt each; vLLM's plugin requests carry opaque `data` (one window). `/classify` with
SGLang's native shape (`text` / `input_ids`) is SGLang's `/encode` (see `sglang_encode.py`). The other
pooling APIs have their own modules: `embeddings.py`, `score.py`, `cohere_embed.py`.

vLLM's `padding: "max_length"` charges every prompt the whole window (see `common.padded`).
"""

from __future__ import annotations

from typing import Any

from extproc.admission.apis.common import optional_model, padded
from extproc.admission.apis.openai import (
    OPENAI_DIALECT,
    OPENAI_SPEC,
    chat_prompt,
    edit_priority,
    text_prompts,
)
from extproc.admission.apis.sglang import NATIVE_INPUTS
from extproc.admission.apis.sglang_encode import SGLangEncodeAdapter
from extproc.admission.apis.spec import BOTH, PROMPT_ONLY, SGLANG, VLLM, ApiSpec, path, shared
from extproc.admission.vocabulary import fields as f
from extproc.admission.vocabulary.parsed import Api, BodyEdits, ParsedRequest
from extproc.admission.vocabulary.prompt import Media, Prompt

IMAGE = Media(images=1)


def pooled(
    api: Api, body: dict[str, Any], prompts: tuple[Prompt, ...], param: str, model: str
) -> ParsedRequest:
    """A request that runs the model on its prompts and generates nothing."""
    return ParsedRequest(
        api=api,
        model=model,
        prompts=padded(body, prompts),
        prompt_param=param,
        generates=False,
        truncate_prompt_tokens=f.truncation(body),
        body=body,
    )


class PoolingAdapter:
    """vLLM `/pooling` and `/classify`, SGLang `/v1/classify` (and SGLang's native `/classify` shape)."""

    api = Api("pooling")

    def parse(self, body: dict[str, Any]) -> ParsedRequest:
        if body.get("input") is None and body.get("messages") is None:
            if any(body.get(key) is not None for key in NATIVE_INPUTS):
                return SGLangEncodeAdapter().parse(body)
            if body.get("data") is not None:
                # vLLM IO-processor plugin request (entrypoints/pooling/pooling/protocol.py:64-80): its
                # `data` becomes prompts the gateway cannot see; one window each at most per request.
                return pooled(self.api, body, (Prompt(opaque=True),), "data", optional_model(body))
        model = optional_model(body)
        if body.get("messages") is not None and body.get("input") is not None:
            # Two shapes in one body: which one the server validates first is not the gateway's to guess.
            f.bad("Send either 'input' or 'messages', not both.", code="invalid_value", param="messages")
        if body.get("messages") is not None:
            return pooled(self.api, body, (chat_prompt(body),), "messages", model)
        return pooled(self.api, body, text_prompts(body, "input"), "input", model)

    def edit(self, req: ParsedRequest, body: dict[str, Any], edits: BodyEdits) -> bool:
        return edit_priority(body, edits)


SPEC = ApiSpec(
    adapter=PoolingAdapter(),
    dialect=shared(OPENAI_DIALECT),
    read=OPENAI_SPEC,
    paths=(
        path("/classify", PROMPT_ONLY, BOTH, ("POST", "PUT")),
        path("/v1/classify", PROMPT_ONLY, SGLANG),
        path("/pooling", PROMPT_ONLY, VLLM),
    ),
)
