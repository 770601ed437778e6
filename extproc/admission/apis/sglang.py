"""SGLang's native API: `/generate` here, and `/encode`, `/classify` (prompt tokens only) in
`sglang_encode.py`, which shares its request shape and dialect.

Request (SGLang v0.5.23 srt/managers/io_struct.py:176-315 `GenerateReqInput`, 1204-1264
`EmbeddingReqInput`): the prompt is one of `text` (a string, or a list: a batch; `/encode` also takes
lists of strings, one cross-encoder pair each), `input_ids` (token ids, or a list of them) or `input_embeds`
(embeddings: opaque, one window each). `image_data`, `video_data`, `audio_data` add media items, per
request of a batch when given as a list of that length. `sampling_params` (one object, or one per request)
bounds the output with `max_new_tokens`: absent means 128, an explicit null the rest of the window
(srt/sampling/sampling_params.py:149). `n` parallel samples replicate each prompt into `n` requests
(io_struct.py:531-557, 589-633), so each sample is its own prompt here too; `beam_width` > 1 decodes that
many beams of one request instead (sampling_params.py:165-168). `session_params` continues a stored session
of unknown size (stored context). The API names no model: requests are metered under `UNNAMED_MODEL`.

Responses carry `meta_info.{id, prompt_tokens, completion_tokens}` per request, in the body (one object, or
a list for a batch) or in every streamed `data:` chunk, cumulative per request, ending with `data: [DONE]`
(srt/entrypoints/http_server.py:946-981, srt/managers/tokenizer_manager.py:2508-2557).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from extproc.admission.apis.common import UNNAMED_MODEL
from extproc.admission.apis.openai import edit_priority, entries, int_value
from extproc.admission.apis.spec import GENERATES, SGLANG, ApiSpec, path
from extproc.admission.vocabulary import fields as f
from extproc.admission.vocabulary.parsed import Api, BodyEdits, ParsedRequest, StepWork
from extproc.admission.vocabulary.prompt import NO_MEDIA, Media, Prompt
from extproc.admission.vocabulary.readspec import ReadSpec, json_text
from extproc.admission.vocabulary.usage import Observed, count_int

NATIVE_INPUTS = ("text", "input_ids", "input_embeds")
MEDIA_FIELDS = {
    "image_data": Media(images=1),
    "video_data": Media(videos=1),
    "audio_data": Media(audios=1),
}
DEFAULT_MAX_NEW_TOKENS = 128
"""SGLang's `max_new_tokens` when the key is absent (srt/sampling/sampling_params.py:149)."""


def _leaves(value: Any) -> int:
    """Media items in one request's field: an item, or a (nested) list of items."""
    if value is None:
        return 0
    if isinstance(value, list):
        return sum(_leaves(v) for v in value)
    return 1


def _media(body: Mapping[str, Any], index: int, batch: int | None) -> Media:
    """Media of request `index`; in a batch a list of the batch's length gives each request its entry, and
    any other shape is charged to every request (never less than the truth)."""
    total = NO_MEDIA
    for key, unit in MEDIA_FIELDS.items():
        value = body.get(key)
        if batch is not None and isinstance(value, list) and len(value) == batch:
            value = value[index]
        count = _leaves(value)
        total = total + Media(unit.images * count, unit.audios * count, unit.videos * count)
    return total


def _input_prompts(body: Mapping[str, Any], encode: bool) -> tuple[list[Prompt], str, bool]:
    """One prompt per request of the body, without media; the field they came from; whether it is a batch."""
    given = [key for key in NATIVE_INPUTS if body.get(key) is not None]
    if len(given) > 1:
        f.bad(
            f"Provide only one of text, input_ids or input_embeds, got {', '.join(given)}.",
            code="invalid_value",
            param=given[1],
        )
    if not given:
        return [], "text", False
    key = given[0]
    value = body[key]
    if key == "text":
        return _texts(value, encode), key, isinstance(value, list)
    if not isinstance(value, list) or not value:
        f.bad(f"'{key}' must be a non-empty array.", code="invalid_type", param=key)
    if key == "input_ids":
        batch = isinstance(value[0], list)
        rows = value if batch else [value]
        for i, ids in enumerate(rows):
            where = f"{key}[{i}]" if batch else key
            if not isinstance(ids, list):
                f.bad(f"'{where}' must be an array of token ids.", code="invalid_type", param=where)
            f.token_ids(ids, where)
        return [Prompt(fixed_tokens=len(ids)) for ids in rows], key, batch
    # input_embeds: one row of floats per token, rows per request; a batch nests one level deeper.
    if not isinstance(value[0], list):
        f.bad("'input_embeds' must be an array of embedding rows.", code="invalid_type", param=key)
    batch = bool(value[0]) and isinstance(value[0][0], list)
    return [Prompt(opaque=True) for _ in (value if batch else [value])], key, batch


def _texts(value: Any, encode: bool) -> list[Prompt]:
    if isinstance(value, str):
        return [Prompt(texts=(value,))]
    if not isinstance(value, list) or not value:
        f.bad("'text' must be a string or a non-empty array of strings.", code="invalid_type", param="text")
    out = []
    for i, item in enumerate(value):
        if isinstance(item, str):
            out.append(Prompt(texts=(item,)))
        elif encode and isinstance(item, list) and all(isinstance(t, str) for t in item):
            out.append(Prompt(texts=tuple(item)))  # a cross-encoder pair
        else:
            f.bad(f"'text[{i}]' must be a string.", code="invalid_type", param=f"text[{i}]")
    return out


def native_prompts(body: Mapping[str, Any], encode: bool) -> tuple[tuple[Prompt, ...], str]:
    """The body's prompts with their media. `/encode` also takes media alone: one request with every item."""
    found, param, batch = _input_prompts(body, encode)
    if not found:
        if not encode or not any(body.get(key) is not None for key in MEDIA_FIELDS):
            f.bad(
                "Either text, input_ids or input_embeds should be provided.",
                code="missing_field",
                param="text",
            )
        found = [Prompt()]
    size = len(found) if batch else None
    return tuple(
        Prompt(
            texts=p.texts,
            fixed_tokens=p.fixed_tokens,
            media=p.media + _media(body, i, size),
            opaque=p.opaque,
        )
        for i, p in enumerate(found)
    ), param


def _sampling_items(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    params = body.get("sampling_params")
    if params is None:
        return [{}]
    if isinstance(params, dict):
        return [params]
    if isinstance(params, list) and params and all(isinstance(p, dict) for p in params):
        return params
    f.bad(
        "'sampling_params' must be an object or a non-empty array of objects.",
        code="invalid_type",
        param="sampling_params",
    )


def _bound(items: list[dict[str, Any]]) -> int | None:
    """The largest output bound over the requests; None when one of them has none (an explicit null)."""
    bounds = []
    for i, params in enumerate(items):
        if "max_new_tokens" not in params:
            bounds.append(DEFAULT_MAX_NEW_TOKENS)
            continue
        value = f.opt_int(
            params, "max_new_tokens", low=0, high=f.MAX_TOKENS_LIMIT, param=_param(items, i, "max_new_tokens")
        )
        if value is None:
            return None
        bounds.append(value)
    return max(bounds)


def _param(items: list[dict[str, Any]], i: int, key: str) -> str:
    return f"sampling_params[{i}].{key}" if len(items) > 1 else f"sampling_params.{key}"


def _fan_out(items: list[dict[str, Any]]) -> tuple[int, int]:
    """(samples per prompt, beams per sample); `n` is the same for every request (io_struct.py:537-545)."""
    ns = {
        f.opt_int(p, "n", low=1, high=f.MAX_N, param=_param(items, i, "n")) or 1 for i, p in enumerate(items)
    }
    if len(ns) > 1:
        f.bad(
            "The parallel_sample_num should be the same for all samples in sample params.",
            code="invalid_value",
            param="sampling_params",
        )
    beams = max(
        f.opt_int(p, "beam_width", low=1, high=f.MAX_N, param=_param(items, i, "beam_width")) or 1
        for i, p in enumerate(items)
    )
    return (1, beams) if beams > 1 else (ns.pop(), 1)


def _least_output(items: list[dict[str, Any]]) -> tuple[int, bool]:
    """(`min_new_tokens`, `ignore_eos`) over the requests of a batch: the largest, and whether any ignores
    EOS (SGLang docs/backend/sampling_params.md "Core Parameters")."""
    least = max(
        f.opt_int(
            p, "min_new_tokens", low=0, high=f.MAX_TOKENS_LIMIT, param=_param(items, i, "min_new_tokens")
        )
        or 0
        for i, p in enumerate(items)
    )
    ignore = any(f.opt_bool(p, "ignore_eos", _param(items, i, "ignore_eos")) for i, p in enumerate(items))
    return least, ignore


def _any(value: Any) -> bool:
    """A per-request field of a batch (a value, or a list of one per request): true for any request."""
    return any(v is True for v in value) if isinstance(value, list) else value is True


def _largest_int(value: Any) -> int | None:
    """The largest integer of a per-request field, None when none is an integer."""
    found = [int_value(v) for v in (value if isinstance(value, list) else [value])]
    ints = [v for v in found if v is not None]
    return max(ints) if ints else None


def _step_work(body: Mapping[str, Any], items: list[dict[str, Any]]) -> StepWork:
    """Per-step work of a native request: `stop` per request, `top_logprobs_num` logprobs when
    `return_logprob`, and prompt logprobs when `logprob_start_len` starts inside the prompt (default -1:
    output only; SGLang docs/backend/sampling_params.md "`/generate` Endpoint")."""
    top: int | None = None
    prompt: int | None = None
    if _any(body.get("return_logprob")):
        top = _largest_int(body.get("top_logprobs_num")) or 0
        start = _largest_int(body.get("logprob_start_len"))
        prompt = top if start is not None and start >= 0 else None
    return StepWork(
        stop=max(entries(p.get("stop")) for p in items),
        logit_bias=max(entries(p.get("logit_bias")) for p in items),
        logprobs=top,
        prompt_logprobs=prompt,
        logprobs_param="top_logprobs_num",
    )


def _stored(body: Mapping[str, Any], found: tuple[Prompt, ...]) -> tuple[str | None, tuple[Prompt, ...]]:
    if body.get("session_params") is None:
        return None, found
    return "session_params", tuple(Prompt(opaque=True) for _ in found)


class SGLangGenerateAdapter:
    api = Api("sglang_generate")

    def parse(self, body: dict[str, Any]) -> ParsedRequest:
        found, param = native_prompts(body, encode=False)
        items = _sampling_items(body)
        samples, beams = _fan_out(items)
        stored, found = _stored(body, found)
        least, ignore_eos = _least_output(items)
        return ParsedRequest(
            api=self.api,
            model=UNNAMED_MODEL,
            prompts=tuple(p for p in found for _ in range(samples)),
            stream=bool(f.opt_bool(body, "stream", "stream")),
            sequences=beams,
            requested_max_tokens=_bound(items),
            max_tokens_param="max_new_tokens",
            prompt_param=param,
            stored_context=stored,
            min_tokens=least,
            ignore_eos=ignore_eos,
            min_tokens_param="min_new_tokens",
            work=_step_work(body, items),
            body=body,
        )

    def edit(self, req: ParsedRequest, body: dict[str, Any], edits: BodyEdits) -> bool:
        changed = False
        if edits.max_tokens is not None and req.requested_max_tokens is None:
            params = copy.deepcopy(body.get("sampling_params"))
            for item in params if isinstance(params, list) else [params]:
                if isinstance(item, dict) and "max_new_tokens" in item and item["max_new_tokens"] is None:
                    item["max_new_tokens"] = edits.max_tokens
                    changed = True
            body["sampling_params"] = params
        return edit_priority(body, edits) or changed


class SGLangDialect:
    """SGLang native results: usage is `meta_info` per request, cumulative while streaming.

    Stateful (one per response): each request of a batch, and each of `n` samples, reports its own counts,
    keyed by `meta_info.id`; the usage is their sum. Streamed `text` is cumulative and never counted.
    """

    def __init__(self) -> None:
        self._prompt: dict[str, int] = {}
        self._completion: dict[str, int] = {}

    def event(self, name: bytes, obj: Mapping[str, Any]) -> Observed:
        return self._read([obj])

    def body(self, obj: Any) -> Observed:
        return self._read(obj if isinstance(obj, list) else [obj])

    def _read(self, results: list[Any]) -> Observed:
        seen = Observed()
        for position, result in enumerate(results):
            if not isinstance(result, dict):
                continue
            if result.get("error") is not None or result.get("object") == "error":
                seen.error = True
            meta = result.get("meta_info")
            if not isinstance(meta, dict):
                continue
            key = meta.get("id")
            key = key if isinstance(key, str) else f"#{result.get('index', position)}"
            prompt, completion = (
                count_int(meta.get("prompt_tokens")),
                count_int(meta.get("completion_tokens")),
            )
            if prompt is not None:
                self._prompt[key] = prompt
            if completion is not None:
                self._completion[key] = completion
            seen.usage_seen = True
        if seen.usage_seen:
            seen.prompt = sum(self._prompt.values()) if self._prompt else None
            seen.completion = sum(self._completion.values())
        return seen


# Cumulative `meta_info` on every event.
SGLANG_SPEC = ReadSpec(content=(json_text("text"),), usage_key="meta_info")

SPEC = ApiSpec(
    adapter=SGLangGenerateAdapter(),
    dialect=SGLangDialect,  # sums per-request counts: a fresh one per response
    read=SGLANG_SPEC,
    paths=(path("/generate", GENERATES, SGLANG, ("POST", "PUT")),),
)
