"""A request's prompt as leading chunks the engine's prefix cache can share (`core/kv/prefix.py`).

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

import itertools
import json
from dataclasses import replace
from typing import Any

from extproc.admission.vocabulary.parsed import ParsedRequest
from extproc.core.kv.prefix import NO_CHUNKS, PromptChunks

CHUNK_CHARS = 256
"""Characters of prompt text per chunk: about 64 tokens of English, so the one chunk of margin the budget
keeps (`PromptChunks.credit`) is about half a GPU engine block of 16 tokens x 8."""

MAX_CHUNKS = 4096
"""Chunks hashed at most (1 MiB of text); a longer prompt's tail is booked as its own."""


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


def _reordered(request: ParsedRequest, in_order: bool) -> bool:
    """Whether the rendered prompt may not start with the texts in their order: a chat template of the
    client's own (`custom_template`, where the operator allows one) can put a shared system prompt last, and
    a model whose template moves a message (`TemplateCosts.in_order` False) does so for every templated
    prompt. A client that could pick the order would otherwise be credited a prefix the engine never
    shares."""
    return request.custom_template is not None or (not in_order and request.prompts[0].templated)


def prompt_chunks(
    request: ParsedRequest, text_tokens: tuple[int, ...] = (), in_order: bool = True
) -> PromptChunks:
    """The request's leading chunks, or none where sharing cannot be told from its text; with each text's
    tokens (`Reservation.text_tokens`, from the exact count), the tokens up to the end of each text, so a
    shared run is credited the tokens of the whole texts it covers (`PromptChunks.credit`).

    None either where the template may not render the texts in order (`_reordered`): the sidecar hashes the
    texts as given, the engine shares what the template put first.

    Each text is cut into chunks of its own (its last one short), so a shared text ends a chunk: cut across
    the joined texts, the run two prompts share stopped at the last whole chunk before they differed, most
    often inside the shared system prompt, which then counted as not covered."""
    if request.prompt_count != 1:
        return NO_CHUNKS
    if _truncating(request.body) or _reordered(request, in_order):
        return NO_CHUNKS
    prompt = request.prompts[0]
    if prompt.media or prompt.opaque or prompt.fixed_tokens or not prompt.texts:
        return NO_CHUNKS
    parent = hash((request.api, request.model, _seed(request.body, request.prompt_param)))
    hashes: list[int] = []
    ends: list[int] = []
    for text in prompt.texts:
        for start in range(0, len(text), CHUNK_CHARS):
            if len(hashes) == MAX_CHUNKS:
                break
            # Whether the piece starts a text: ("x" * 256, "y") and ("x" * 256 + "y",) differ.
            parent = hash((parent, text[start : start + CHUNK_CHARS], start == 0))
            hashes.append(parent)
        else:
            ends.append(len(hashes))
            continue
        break
    chars = sum(len(text) for text in prompt.texts)
    chunks = PromptChunks(tuple(hashes), CHUNK_CHARS, max(1, chars), tuple(ends))
    return with_text_tokens(chunks, text_tokens)


def with_text_tokens(chunks: PromptChunks, counts: tuple[int, ...]) -> PromptChunks:
    """`chunks` with the tokens of its texts up to each one's end, from one count per text of the prompt
    (none without them: a prompt booked on its bound is credited nothing until its exact count)."""
    if not counts or len(counts) < len(chunks.text_ends) or chunks.text_tokens:
        return chunks
    return replace(chunks, text_tokens=tuple(itertools.accumulate(counts[: len(chunks.text_ends)])))


def _seed(body: dict[str, Any], prompt_field: str) -> str:
    """Everything in the body that may render into the prompt, but the prompt's own field."""
    rest = {k: v for k, v in body.items() if k != prompt_field and k not in UNRENDERED}
    if not rest:
        return ""
    try:
        return json.dumps(rest, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=repr)
    except (TypeError, ValueError):  # a key JSON cannot sort: nothing shares this seed
        return repr(object())
