"""A request's prompt as leading chunks the engine's prefix cache can share (`core/prefix_index.py`).

The engine hashes a prompt's token blocks, each hash chained over its parent's (vLLM 0.32.0
`v1/core/kv_cache_utils.py` `hash_block_tokens`: the parent's hash, the block's token ids, extra keys such as
the LoRA adapter, media and `cache_salt`), and holds a leading run of blocks once for every request whose
prompt starts with it. The sidecar has no engine tokens on the verdict's path, so it chains hashes over
fixed-size pieces of the prompt's text instead: two prompts share exactly the chunks of their common
leading text, which the engine renders into the same leading tokens.

What may change the rendered prompt ahead of the text (the model, the API, a custom chat template, tools,
documents, a system field, `cache_salt`, any field this module does not know) seeds the first hash, so
two requests share chunks only when all of it is equal; only fields that cannot reach the prompt (sampling,
streaming, output bounds) are left out of the seed. Requests with media, several prompts, or prompts not
given as text (token ids, embeddings) bring no chunks: they are booked whole, the safe direction. So do
requests that ask the engine to truncate their prompt (`_truncating`): what it keeps is not the text's lead.

Cost: one `hash` per `CHUNK_CHARS` of text (SipHash over the slice) plus the seed's compact JSON; at most
`MAX_CHUNKS` chunks, past which the rest of a prompt is its own.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from extproc.admission.vocabulary.parsed import ParsedRequest
from extproc.core.prefix_index import NO_CHUNKS, PromptChunks

CHUNK_CHARS = 256
"""Characters of prompt text per chunk: about 64 tokens of English, so the one chunk of margin the budget
keeps (`PromptChunks.credit`) is about half a GPU engine block of 16 tokens x 8."""

MAX_CHUNKS = 4096
"""Chunks hashed at most (1 MiB of text); a longer prompt's tail is booked as its own."""

SEPARATOR = "\x1e"
"""Between two texts of a prompt (ASCII record separator), so ("ab", "c") and ("a", "bc") differ."""

UNRENDERED = frozenset(
    {
        "max_tokens",
        "max_completion_tokens",
        "max_output_tokens",
        "min_tokens",
        "n",
        "best_of",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "stream",
        "stream_options",
        "stop",
        "stop_sequences",
        "stop_token_ids",
        "ignore_eos",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "logprobs",
        "top_logprobs",
        "logit_bias",
        "user",
        "metadata",
        "priority",
        "request_id",
        "service_tier",
        "store",
    }
)
"""Body fields that never reach the rendered prompt (sampling, streaming, bounds): left out of the seed, so
requests differing only in them share their prefix. Every other field seeds it."""


def _truncating(body: dict[str, Any]) -> bool:
    """Whether the body asks the engine to cut the prompt: the text's leading chunks may then not be what the
    engine holds (a cut from the left shifts every block), so none is credited. vLLM's
    `truncate_prompt_tokens` keeps the last N tokens of the rendered prompt (-1: the model's length; vllm
    0.32.0 vllm/entrypoints/openai/chat_completion/protocol.py, completion/protocol.py,
    pooling/base/protocol.py); OpenAI Responses' `truncation: "auto"` drops items from the start of a
    conversation that outgrows the context."""
    return body.get("truncate_prompt_tokens") is not None or body.get("truncation") not in (None, "disabled")


def prompt_chunks(request: ParsedRequest, text_tokens: tuple[int, ...] = ()) -> PromptChunks:
    """The request's leading chunks, or none where sharing cannot be told from its text; with each text's
    tokens (`Reservation.text_tokens`, from the exact count), where each text ends and the tokens up to
    there, so a shared run is credited the tokens of the whole texts it covers (`PromptChunks.credit`)."""
    if request.prompt_count != 1:
        return NO_CHUNKS
    if _truncating(request.body):
        return NO_CHUNKS
    prompt = request.prompts[0]
    if prompt.media or prompt.opaque or prompt.fixed_tokens or not prompt.texts:
        return NO_CHUNKS
    text = SEPARATOR.join(prompt.texts)
    parent = hash((request.api, request.model, _seed(request.body, request.prompt_param)))
    hashes = []
    for start in range(0, min(len(text), CHUNK_CHARS * MAX_CHUNKS), CHUNK_CHARS):
        parent = hash((parent, text[start : start + CHUNK_CHARS]))
        hashes.append(parent)
    ends, tokens = _text_ends(prompt.texts, text_tokens)
    return PromptChunks(tuple(hashes), CHUNK_CHARS, len(text), ends, tokens)


def with_text_tokens(chunks: PromptChunks, texts: tuple[str, ...], counts: tuple[int, ...]) -> PromptChunks:
    """`chunks`, hashed before the prompt was counted, with where its texts end and their tokens."""
    ends, tokens = _text_ends(texts, counts)
    return replace(chunks, text_ends=ends, text_tokens=tokens) if tokens else chunks


def _text_ends(texts: tuple[str, ...], counts: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Where each text ends in the joined prompt text, and the tokens of the texts up to there: none
    without one count per text (a prompt booked on its bound is credited nothing until its exact count)."""
    if len(counts) != len(texts):
        return (), ()
    ends: list[int] = []
    tokens: list[int] = []
    end = total = 0
    for i, (text, count) in enumerate(zip(texts, counts, strict=True)):
        end += len(text) + (1 if i else 0)  # the separator before every text but the first
        total += count
        ends.append(end)
        tokens.append(total)
    return tuple(ends), tuple(tokens)


def _seed(body: dict[str, Any], prompt_field: str) -> str:
    """Everything in the body that may render into the prompt, but the prompt's own field."""
    rest = {k: v for k, v in body.items() if k != prompt_field and k not in UNRENDERED}
    if not rest:
        return ""
    try:
        return json.dumps(rest, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=repr)
    except (TypeError, ValueError):  # a key JSON cannot sort: nothing shares this seed
        return repr(object())
