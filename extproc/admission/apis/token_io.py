"""vLLM's token-in/token-out generation, `POST /inference/v1/generate`.

Request (vLLM v0.33.0 entrypoints/scale_out/token_in_token_out/protocol.py:221-370 `GenerateRequest`): the
prompt is `token_ids`, counted by length (the placeholders of pre-processed media in `features` are already
among them, protocol.py:103-110); `content_parts` are raw media the server fetches and expands into
placeholder tokens (serving.py:273-295), charged the model's media cost each. `sampling_params` is a vLLM
`SamplingParams`: `max_tokens` bounds each of `n` sequences, and absent it is the rest of the window
(serving.py:348-356). `model` is optional. Streams follow `stream_options` as chat does (usage only when
`include_usage`, in a final chunk with `"choices": []`, then `data: [DONE]`; serving.py:665-810).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from extproc.admission.apis.common import optional_model
from extproc.admission.apis.openai import (
    MEDIA_PARTS,
    ask_for_usage,
    completion_step_work,
    edit_priority,
    read_openai_usage,
)
from extproc.admission.apis.spec import VLLM, ApiSpec, path, shared
from extproc.admission.vocabulary import fields as f
from extproc.admission.vocabulary.parsed import Api, BodyEdits, ParsedRequest
from extproc.admission.vocabulary.prompt import NO_MEDIA, Prompt
from extproc.admission.vocabulary.readspec import ReadSpec, json_key, json_text
from extproc.admission.vocabulary.usage import Observed

CONTENT_PART_TYPES = ("image_url", "audio_url", "video_url")
"""Raw media the server resolves (serving.py:276-285); other part types are ignored there."""


def _media_prompt(body: Mapping[str, Any], ids: list[int]) -> Prompt:
    parts = f.opt_list(body, "content_parts", "content_parts") or []
    if parts and body.get("features") is not None:
        # protocol.py:254-257
        f.bad(
            "content_parts and features are mutually exclusive.", code="invalid_value", param="content_parts"
        )
    media = NO_MEDIA
    for j, part in enumerate(parts):
        if not isinstance(part, dict):
            f.bad(
                f"'content_parts[{j}]' must be an object.", code="invalid_type", param=f"content_parts[{j}]"
            )
        kind = part.get("type")
        if kind in CONTENT_PART_TYPES:
            media = media + MEDIA_PARTS[kind]
    return Prompt(fixed_tokens=len(ids), media=media)


class GenerateTokensAdapter:
    api = Api("generate_tokens")

    def parse(self, body: dict[str, Any]) -> ParsedRequest:
        model = optional_model(body)
        ids = f.opt_list(body, "token_ids", "token_ids")
        if not ids:
            f.bad(
                "'token_ids' must be a non-empty array of token ids.", code="missing_field", param="token_ids"
            )
        f.token_ids(ids, "token_ids")
        params = f.opt_object(body, "sampling_params", "sampling_params")
        if params is None:
            f.bad(
                "Missing required parameter: 'sampling_params'.",
                code="missing_field",
                param="sampling_params",
            )
        stream, include_usage = f.stream_options(body)
        # `sampling_params` is vLLM's `SamplingParams` itself (vLLM v0.32.0
        # entrypoints/scale_out/token_in_token_out/protocol.py): the same least output and per-step work.
        least, ignore_eos = f.least_output(params, "sampling_params.")
        return ParsedRequest(
            api=self.api,
            model=model,
            prompts=(_media_prompt(body, ids),),
            stream=stream,
            include_usage=include_usage,
            sequences=f.opt_int(params, "n", low=1, high=f.MAX_N, param="sampling_params.n") or 1,
            requested_max_tokens=f.opt_int(
                params, "max_tokens", low=1, high=f.MAX_TOKENS_LIMIT, param="sampling_params.max_tokens"
            ),
            max_tokens_param="sampling_params.max_tokens",
            prompt_param="token_ids",
            min_tokens=least,
            ignore_eos=ignore_eos,
            min_tokens_param="sampling_params.min_tokens",
            work=completion_step_work(params),
            body=body,
        )

    def edit(self, req: ParsedRequest, body: dict[str, Any], edits: BodyEdits) -> bool:
        changed = ask_for_usage(body, req, edits)
        if edits.max_tokens is not None and req.requested_max_tokens is None:
            params = copy.deepcopy(body["sampling_params"])
            params["max_tokens"] = edits.max_tokens
            body["sampling_params"] = params
            changed = True
        return edit_priority(body, edits) or changed


class TokenIdsDialect:
    """OpenAI-shaped chunks and bodies whose choices carry `token_ids` (and `text` in text mode): a token id
    is a generated token, so the count needs no tokenizer."""

    def event(self, name: bytes, obj: Mapping[str, Any]) -> Observed:
        return self._read(obj)

    def body(self, obj: Any) -> Observed:
        return self._read(obj) if isinstance(obj, dict) else Observed()

    def _read(self, obj: Mapping[str, Any]) -> Observed:
        seen = Observed.of_body(obj)
        choices = obj.get("choices")
        for choice in choices if isinstance(choices, list) else []:
            if not isinstance(choice, dict):
                continue
            ids, text = choice.get("token_ids"), choice.get("text")
            if isinstance(ids, list):
                seen.tokens += len(ids)
            elif isinstance(text, str):
                seen.texts.append(text)
        read_openai_usage(obj, seen)
        return seen


TOKEN_IDS_DIALECT = TokenIdsDialect()


# Each id is one generated token.
TOKEN_IDS_SPEC = ReadSpec(
    content=(json_key("token_ids") + "%[%s*%d", json_text("text")),
    usage_only=json_key("choices") + "%[%s*%]",
)

SPEC = ApiSpec(
    adapter=GenerateTokensAdapter(),
    dialect=shared(TOKEN_IDS_DIALECT),
    read=TOKEN_IDS_SPEC,
    paths=(path("/inference/v1/generate", "generates from token ids", VLLM),),
    usage_option=True,
)
