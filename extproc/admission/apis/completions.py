"""OpenAI's completions, `POST /v1/completions`: one prompt per entry of `prompt` (text or token ids), each
of vLLM's `prompt_embeds` an opaque prompt before them; `best_of` sequences decoded per prompt."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from extproc.admission.apis.openai import (
    OPENAI_DIALECT,
    OPENAI_SPEC,
    completion_step_work,
    edit_generation,
    text_prompts,
)
from extproc.admission.apis.spec import BOTH, GENERATES, ApiSpec, path, shared
from extproc.admission.vocabulary import fields as f
from extproc.admission.vocabulary.parsed import Api, BodyEdits, ParsedRequest
from extproc.admission.vocabulary.prompt import Prompt


def _prompt_embeds(body: Mapping[str, Any]) -> tuple[Prompt, ...]:
    """`prompt_embeds` (vLLM: one base64 tensor or a list of them): each is a prompt rendered before any
    `prompt` (vLLM v0.33.0 renderers/online_renderer.py:713-726) whose length cannot be known without the
    model, so each is opaque."""
    value = body.get("prompt_embeds")
    if value is None:
        return ()
    return tuple(Prompt(opaque=True) for _ in (value if isinstance(value, list) else [value]))


class CompletionsAdapter:
    api = Api("completions")

    def parse(self, body: dict[str, Any]) -> ParsedRequest:
        model = f.model_name(body)
        stream, include_usage = f.stream_options(body, only_when_streamed=True)
        n = f.opt_int(body, "n", low=1, high=f.MAX_N) or 1
        best_of = f.opt_int(body, "best_of", low=1, high=f.MAX_N) or 1
        requested = f.opt_int(body, "max_tokens", low=1, high=f.MAX_TOKENS_LIMIT)
        embeds = _prompt_embeds(body)
        found = embeds if embeds and body.get("prompt") is None else embeds + text_prompts(body, "prompt")
        least, ignore_eos = f.least_output(body)
        return ParsedRequest(
            api=self.api,
            model=model,
            prompts=found,
            stream=stream,
            include_usage=include_usage,
            sequences=max(n, best_of),  # the backend decodes best_of sequences and returns n
            requested_max_tokens=requested,
            prompt_param="prompt",
            truncate_prompt_tokens=f.truncation(body),
            min_tokens=least,
            ignore_eos=ignore_eos,
            work=completion_step_work(body),
            body=body,
        )

    def edit(self, req: ParsedRequest, body: dict[str, Any], edits: BodyEdits) -> bool:
        return edit_generation(body, req, edits)


SPEC = ApiSpec(
    adapter=CompletionsAdapter(),
    dialect=shared(OPENAI_DIALECT),
    read=OPENAI_SPEC,
    paths=(path("/v1/completions", GENERATES, BOTH),),
    usage_option=True,
)
