"""OpenAI's chat completions, `POST /v1/chat/completions`, as vLLM and SGLang serve them: one prompt, the
conversation rendered by the chat template (counting rules in `openai.py`), `n` sequences, usage in the
stream only when asked."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from extproc.admission.apis.openai import (
    OPENAI_DIALECT,
    OPENAI_SPEC,
    chat_output_bound,
    chat_prompt,
    chat_step_work,
    edit_generation,
)
from extproc.admission.apis.spec import GENERATES, ApiSpec, path, shared
from extproc.admission.vocabulary import fields as f
from extproc.admission.vocabulary.parsed import Api, BodyEdits, ParsedRequest
from extproc.admission.vocabulary.prompt import Prompt


def _with_input_ids(prompt: Prompt, body: Mapping[str, Any]) -> Prompt:
    """SGLang's chat takes pre-tokenized `input_ids` that replace the rendered messages (SGLang v0.5.23
    srt/entrypoints/openai/protocol.py:1044-1047, serving_chat.py:1945-1951); they are counted on top of the
    messages, so the prompt is never below what either server renders."""
    ids = f.opt_list(body, "input_ids", "input_ids")
    if not ids:
        return prompt
    f.token_ids(ids, "input_ids")
    return replace(prompt, fixed_tokens=prompt.fixed_tokens + len(ids))


class ChatAdapter:
    api = Api("chat")

    def parse(self, body: dict[str, Any]) -> ParsedRequest:
        model = f.model_name(body)
        stream, include_usage = f.stream_options(body, only_when_streamed=True)
        n = f.opt_int(body, "n", low=1, high=f.MAX_N) or 1
        requested, param = chat_output_bound(body)
        least, ignore_eos = f.least_output(body)
        return ParsedRequest(
            api=self.api,
            model=model,
            prompts=(_with_input_ids(chat_prompt(body), body),),
            stream=stream,
            include_usage=include_usage,
            sequences=n,
            requested_max_tokens=requested,
            max_tokens_param=param,
            prompt_param="messages",
            truncate_prompt_tokens=f.truncation(body),
            min_tokens=least,
            ignore_eos=ignore_eos,
            work=chat_step_work(body),
            body=body,
        )

    def edit(self, req: ParsedRequest, body: dict[str, Any], edits: BodyEdits) -> bool:
        return edit_generation(body, req, edits)


SPEC = ApiSpec(
    adapter=ChatAdapter(),
    dialect=shared(OPENAI_DIALECT),
    read=OPENAI_SPEC,
    paths=(path("/v1/chat/completions", GENERATES),),
    usage_option=True,
)
