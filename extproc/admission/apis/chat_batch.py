"""vLLM's batch chat completions, `POST /v1/chat/completions/batch`.

`messages` is a list of conversations; each is rendered and generated on its own, one choice per
conversation (vLLM v0.33.0 entrypoints/openai/chat_completion/protocol.py:1140-1262
`BatchChatCompletionRequest`), so each is one prompt here with the request's output bound. `n` must be 1
(protocol.py:1255-1259); there is no `stream` (the answer is one JSON body). Each conversation becomes
a chat request built from every other field of the body, extra fields included (vLLM v0.32.0
chat_completion/protocol.py:1226-1232 `to_chat_completion_request` dumps the model, whose extra fields are
allowed), so `tools`, `documents` and `chat_template_kwargs` are rendered into every conversation and
`truncate_prompt_tokens`, `min_tokens`, `ignore_eos` and the per-step fields apply as in chat.
"""

from __future__ import annotations

from typing import Any

from extproc.admission.apis.openai import (
    OPENAI_DIALECT,
    OPENAI_SPEC,
    chat_output_bound,
    chat_prompt,
    chat_step_work,
    edit_bound,
)
from extproc.admission.apis.spec import VLLM, ApiSpec, path, shared
from extproc.admission.vocabulary import fields as f
from extproc.admission.vocabulary.parsed import Api, BodyEdits, ParsedRequest


class ChatBatchAdapter:
    api = Api("chat_batch")

    def parse(self, body: dict[str, Any]) -> ParsedRequest:
        model = f.model_name(body)
        conversations = body.get("messages")
        if conversations is None:
            f.bad("Missing required parameter: 'messages'.", code="missing_field", param="messages")
        if not isinstance(conversations, list) or not conversations:
            f.bad(
                "'messages' must be a non-empty array of conversations.",
                code="invalid_type",
                param="messages",
            )
        if f.opt_int(body, "n", low=1, high=f.MAX_N) not in (None, 1):
            f.bad(
                "Batch chat completions do not support `n > 1`. Please set `n` to 1.",
                code="invalid_value",
                param="n",
            )
        shared = {key: value for key, value in body.items() if key != "messages"}
        prompts = tuple(
            chat_prompt({**shared, f"messages[{i}]": conversation}, key=f"messages[{i}]")
            for i, conversation in enumerate(conversations)
        )
        requested, param = chat_output_bound(body)
        least, ignore_eos = f.least_output(body)
        return ParsedRequest(
            api=self.api,
            model=model,
            prompts=prompts,
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
        return edit_bound(body, req, edits)


SPEC = ApiSpec(
    adapter=ChatBatchAdapter(),
    dialect=shared(OPENAI_DIALECT),
    read=OPENAI_SPEC,
    paths=(path("/v1/chat/completions/batch", "generates, one prompt per conversation", VLLM),),
)
