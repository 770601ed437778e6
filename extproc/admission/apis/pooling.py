"""Pooling, scoring, reranking and tokenizer APIs: prompt tokens only, nothing is generated.

Cohere's `/v2/embed` is pooling too, with its own schema and usage: `cohere_embed.py`.

* `/pooling`, `/classify` (vLLM), `/v1/classify` (SGLang): `input` (string, strings, token ids) or chat
  `messages`, one prompt each; vLLM's plugin requests carry opaque `data` (one window). `/classify` with
  SGLang's native shape (`text` / `input_ids`) is SGLang's `/encode` (see `sglang.py`).
* Score and rerank (`/score`, `/v1/score`, `/rerank`, `/v1/rerank`, `/v2/rerank`): one prompt per (query,
  document) pair; a single query is replicated into every pair (vLLM v0.33.0
  entrypoints/pooling/scoring/io_processor.py:541-545), so N documents cost N x (query + document).
* `/tokenize` renders and tokenizes, fetching and processing media for chat messages, and `/detokenize`
  decodes token ids: no model runs, but the work grows with the prompt, so they are metered as prompts.

vLLM's `padding: "max_length"` charges every prompt the whole window (see `common.padded`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from extproc.admission import fields as f
from extproc.admission.apis.common import drop_priority, optional_model, padded
from extproc.admission.apis.openai import (
    OPENAI_DIALECT,
    OPENAI_SPEC,
    ContentTexts,
    chat_prompt,
    edit_priority,
    text_prompts,
    truncation,
)
from extproc.admission.apis.sglang import NATIVE_INPUTS, SGLangEncodeAdapter
from extproc.admission.apis.spec import BOTH, PROMPT_ONLY, SGLANG, VLLM, ApiSpec, path, shared
from extproc.admission.parsed import Api, BodyEdits, ParsedRequest
from extproc.admission.prompt import Media, Prompt
from extproc.admission.usage import Observed, count_int

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
        truncate_prompt_tokens=truncation(body),
        body=body,
    )


class PoolingAdapter:
    """vLLM `/pooling` and `/classify`, SGLang `/v1/classify` (and SGLang's native `/classify` shape)."""

    api = Api.POOLING

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


# ----------------------------------------------------------------------------------------------------
# Score and rerank

SCORE_SHAPES = (
    ("query", "documents"),  # rerank (vLLM, SGLang)
    ("queries", "documents"),  # vLLM score
    ("queries", "items"),
    ("data_1", "data_2"),
    ("text_1", "text_2"),
    ("query", "items"),  # SGLang /v1/score
)
"""The (queries, documents) field pairs of the score and rerank schemas (vLLM v0.33.0
entrypoints/pooling/scoring/protocol.py:81-136; SGLang v0.5.23 srt/entrypoints/openai/protocol.py:1482-1488,
1687-1697)."""


def _element(value: Any, param: str) -> Prompt:
    """One query or document: a string, token ids, `{"content": [parts]}`, or a list of content parts."""
    if isinstance(value, str):
        return Prompt(texts=(value,))
    if isinstance(value, dict):
        value = value.get("content")
        param = f"{param}.content"
        if not isinstance(value, list):
            f.bad(f"'{param}' must be an array of content parts.", code="invalid_type", param=param)
    if not isinstance(value, list) or not value:
        f.bad(
            f"'{param}' must be a string, token ids or content parts, got {f.json_type(value)}.",
            code="invalid_type",
            param=param,
        )
    if all(type(v) is int for v in value):
        f.token_ids(value, param)
        return Prompt(fixed_tokens=len(value))
    parts = ContentTexts()
    for j, part in enumerate(value):
        parts.add_part(part, f"{param}[{j}]")
    return Prompt(texts=tuple(parts.texts), media=parts.media)


def _side(value: Any, param: str, single: bool) -> list[Prompt]:
    """The elements of one side: `single` sides hold one element, others one or a list of elements."""
    if value is None:
        f.bad(f"Missing required parameter: '{param}'.", code="missing_field", param=param)
    if isinstance(value, list) and not value:
        f.bad(f"'{param}' must not be empty.", code="invalid_value", param=param)
    if single or not isinstance(value, list) or all(type(v) is int for v in value):
        return [_element(value, param)]
    return [_element(v, f"{param}[{i}]") for i, v in enumerate(value)]


def _join(query: Prompt, document: Prompt, instruction: tuple[str, ...]) -> Prompt:
    return Prompt(
        texts=instruction + query.texts + document.texts,
        fixed_tokens=query.fixed_tokens + document.fixed_tokens,
        templated=True,
        media=query.media + document.media,
    )


def score_pairs(body: Mapping[str, Any]) -> tuple[tuple[Prompt, ...], str]:
    """One prompt per pair, and the field the queries came from; lengths must be 1:1, 1:N or N:N (vLLM
    v0.33.0 entrypoints/pooling/scoring/utils.py:111-123)."""
    shapes = [(a, b) for a, b in SCORE_SHAPES if body.get(a) is not None and body.get(b) is not None]
    if not shapes:
        f.bad(
            "Expected a query and documents: one of "
            + ", ".join(f"'{a}' with '{b}'" for a, b in SCORE_SHAPES)
            + ".",
            code="missing_field",
            param=None,
        )
    if len(shapes) > 1:
        # The server's schema is a union: which shape it takes is not the gateway's to guess.
        f.bad(
            "Send one query and documents shape, got "
            + ", ".join(f"'{a}' with '{b}'" for a, b in shapes)
            + ".",
            code="invalid_value",
            param=shapes[1][0],
        )
    first, second = shapes[0]
    queries = _side(body[first], first, single=first == "query")
    documents = _side(body[second], second, single=False)
    if len(queries) not in (1, len(documents)):
        f.bad("Input lengths must be either 1:1, 1:N or N:N.", code="invalid_value", param=second)
    instruction = tuple(
        value for key in ("instruction", "instruct") if isinstance(value := body.get(key), str)
    )
    if len(queries) == 1:
        queries = queries * len(documents)
    return tuple(_join(q, d, instruction) for q, d in zip(queries, documents, strict=True)), first


class ScoreAdapter:
    api = Api.SCORE

    def parse(self, body: dict[str, Any]) -> ParsedRequest:
        model = optional_model(body)
        pairs, param = score_pairs(body)
        return pooled(self.api, body, pairs, param, model)

    def edit(self, req: ParsedRequest, body: dict[str, Any], edits: BodyEdits) -> bool:
        return edit_priority(body, edits)


# ----------------------------------------------------------------------------------------------------
# Tokenizer endpoints


class TokenizeAdapter:
    """`/tokenize`: a `prompt` (a string; SGLang also takes a list) or chat `messages` with `tools` (vLLM
    v0.33.0 entrypoints/serve/tokenize/protocol.py:23-60; SGLang v0.5.23 openai/protocol.py:1744-1752)."""

    api = Api.TOKENIZE

    def parse(self, body: dict[str, Any]) -> ParsedRequest:
        model = optional_model(body)
        if body.get("messages") is not None:
            return pooled(self.api, body, (chat_prompt(body),), "messages", model)
        return pooled(self.api, body, text_prompts(body, "prompt"), "prompt", model)

    def edit(self, req: ParsedRequest, body: dict[str, Any], edits: BodyEdits) -> bool:
        return drop_priority(body, edits)


class DetokenizeAdapter:
    """`/detokenize`: `tokens`, token ids (SGLang also takes a list of them); each id is a token."""

    api = Api.DETOKENIZE

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


# ----------------------------------------------------------------------------------------------------
# Specs: these APIs answer with one JSON body, read whole by the dialect (the OpenAI read spec never
# matches a JSON body's events).

PAIRS = "runs the model on each (query, document) pair"
NO_MODEL = "decodes token ids; no model runs"

POOLING = ApiSpec(
    api=Api.POOLING,
    adapter=PoolingAdapter(),
    dialect=shared(OPENAI_DIALECT),
    read=OPENAI_SPEC,
    paths=(
        path("/classify", PROMPT_ONLY, BOTH, ("POST", "PUT")),
        path("/v1/classify", PROMPT_ONLY, SGLANG),
        path("/pooling", PROMPT_ONLY, VLLM),
    ),
)
SCORE = ApiSpec(
    api=Api.SCORE,
    adapter=ScoreAdapter(),
    dialect=shared(OPENAI_DIALECT),
    read=OPENAI_SPEC,
    paths=(
        path("/score", PAIRS, VLLM),
        path("/v1/score", "runs the model on each (query, item) pair"),
        path("/rerank", PAIRS, VLLM),
        path("/v1/rerank", PAIRS, BOTH, ("POST", "PUT")),
        path("/v2/rerank", PAIRS, VLLM),
    ),
)
TOKENIZE = ApiSpec(
    api=Api.TOKENIZE,
    adapter=TokenizeAdapter(),
    dialect=shared(TOKENIZE_DIALECT),
    read=OPENAI_SPEC,
    paths=(
        path("/tokenize", "renders the chat template and processes media; no model runs"),
        path("/v1/tokenize", "tokenizes; no model runs", SGLANG),
    ),
)
DETOKENIZE = ApiSpec(
    api=Api.DETOKENIZE,
    adapter=DetokenizeAdapter(),
    dialect=shared(OPENAI_DIALECT),
    read=OPENAI_SPEC,
    paths=(path("/detokenize", NO_MODEL), path("/v1/detokenize", NO_MODEL, SGLANG)),
)
