"""A metered request, whatever API it came from: its facts, its cost, and how its body may be edited.

The work is split by cost so admission can decide as early and as cheaply as possible:

1. `parse_request` decodes JSON and validates the fields that drive admission, through the API's adapter
   (`extproc/admission/apis/`). It never tokenizes, so it is safe to run on the event loop. A malformed
   request is refused here with the 400 the backend would have returned.
2. `prompt_token_lower_bound` is arithmetic on byte counts gathered while parsing: a request whose bound
   already exceeds the context window is refused without tokenizing it.
3. `count_prompt_tokens` tokenizes (CPU heavy; tiktoken releases the GIL), stopping once a prompt is
   proven larger than the context window.
4. `plan_reservation` applies the context-window check per prompt and sizes the completion reservation:
   always an upper bound of what the backend may generate.

`edit_body` rewrites a request before it goes upstream: ask for usage in a stream (so settlement is exact),
write an output bound (under `missing_max_tokens: inject`), and strip or set the scheduling priority.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field
from typing import Any, NoReturn, Protocol

from extproc.admission import prompt as prompts
from extproc.admission.errors import AdmissionError
from extproc.admission.fields import load_object
from extproc.admission.policy import MissingMaxTokens, ModelPolicy
from extproc.admission.prompt import Count, Prompt


class Api(enum.StrEnum):
    """The request shapes the sidecar meters; each has one adapter in `extproc/admission/apis/`."""

    CHAT = "chat"
    COMPLETIONS = "completions"
    EMBEDDINGS = "embeddings"
    CHAT_BATCH = "chat_batch"  # vLLM /v1/chat/completions/batch: one conversation per prompt
    RESPONSES = "responses"  # OpenAI Responses (/v1/responses)
    MESSAGES = "messages"  # Anthropic Messages (/v1/messages)
    INVOCATIONS = "invocations"  # SageMaker: resolved by body shape; a parsed request names the API found
    GENERATE_TOKENS = "generate_tokens"  # vLLM token-in/token-out (/inference/v1/generate)
    SGLANG_GENERATE = "sglang_generate"  # SGLang native /generate
    SGLANG_ENCODE = "sglang_encode"  # SGLang native /encode and /classify: prompt tokens only
    POOLING = "pooling"  # vLLM /pooling, /classify, SGLang /v1/classify: prompt tokens only
    SCORE = "score"  # score and rerank: one prompt per (query, document) pair
    COHERE_EMBED = "cohere_embed"  # vLLM /v2/embed (Cohere's embed schema)
    TOKENIZE = "tokenize"  # renders and tokenizes (media included), runs no model
    DETOKENIZE = "detokenize"


USAGE_OPTION_APIS = frozenset({Api.CHAT, Api.COMPLETIONS, Api.GENERATE_TOKENS})
"""APIs whose streams report usage only when asked (`stream_options.include_usage`)."""

ALLOW_STORED_CONTEXT = False
"""Default for requests that prepend a conversation stored on the backend (Responses
`previous_response_id`, SGLang `session_params`): refused, since its size is unknown to the gateway. When
allowed, such a prompt is opaque and charged the whole context window."""


@dataclass(frozen=True)
class ParsedRequest:
    """The admission-relevant facts of a validated request, plus the parsed body for re-serialisation."""

    api: Api
    model: str
    prompts: tuple[Prompt, ...]
    stream: bool = False
    include_usage: bool = False  # the client asked for usage in the stream (chat, completions)
    # Sequences the backend decodes per prompt, each holding KV cache for its completion (n, best_of).
    sequences: int = 1
    requested_max_tokens: int | None = None
    max_tokens_param: str = "max_tokens"  # named in context-length errors
    prompt_param: str = "prompt"  # named in context-length errors ("messages", "prompt", "input")
    generates: bool = True  # False for pooling APIs: no completion is reserved
    # The field that prepends a conversation stored on the backend, when the request uses one.
    stored_context: str | None = None
    body: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def prompt_count(self) -> int:
        return len(self.prompts)

    @property
    def text_bytes(self) -> int:
        return sum(p.text_bytes for p in self.prompts)


@dataclass(frozen=True, slots=True)
class Reservation:
    """Tokens to hold against the budget while the request runs; settled later against actual usage."""

    prompt_tokens: int  # sum over prompts
    completion_tokens: int  # reserved for output: per-sequence bound x sequences x prompts (0 for pooling)
    # The bound written into the body (missing_max_tokens: inject), None when the body keeps its own.
    injected_max_tokens: int | None = None

    @property
    def total(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True, slots=True)
class BodyEdits:
    """Changes to a request body before it goes upstream (see `edit_body`)."""

    include_usage: bool = False
    max_tokens: int | None = None
    strip_priority: bool = False
    priority: int | None = None

    def __bool__(self) -> bool:
        return self.include_usage or self.max_tokens is not None or self.strip_priority


class Adapter(Protocol):
    """One API: validation into `ParsedRequest`, and the body edits it supports."""

    api: Api

    def parse(self, body: dict[str, Any]) -> ParsedRequest: ...

    def edit(self, req: ParsedRequest, body: dict[str, Any], edits: BodyEdits) -> bool:
        """Apply `edits` to `body` (a shallow copy the caller owns); True when anything changed."""
        ...


def adapter_for(api: Api) -> Adapter:
    from extproc.admission.apis import ADAPTERS

    return ADAPTERS[api]


def parse_request(
    api: Api, raw: bytes, *, allow_stored_context: bool = ALLOW_STORED_CONTEXT
) -> ParsedRequest:
    """Decode and validate a request body; cheap (JSON and field checks only, no tokenizing).

    Raises AdmissionError(400) naming the offending field. Unknown fields pass through untouched. A request
    that prepends a stored conversation is refused unless `allow_stored_context` (see
    `ALLOW_STORED_CONTEXT`).
    """
    try:
        parsed = adapter_for(api).parse(load_object(raw))
    except RecursionError:  # validation never recurses deeply, but be certain no body can crash the caller
        raise AdmissionError(
            400, "Request body nests too deeply to be parsed.", code="invalid_json", param=None
        ) from None
    if parsed.stored_context is not None and not allow_stored_context:
        raise AdmissionError(
            400,
            f"'{parsed.stored_context}' is not accepted by this gateway: a stored conversation of unknown "
            "size cannot be metered. Send the conversation in the request instead.",
            code="unsupported_parameter",
            param=parsed.stored_context,
        )
    return parsed


# ----------------------------------------------------------------------------------------------------
# Counting


def count_prompt_tokens(req: ParsedRequest, policy: ModelPolicy) -> list[Count]:
    """Tokens of each prompt; CPU heavy, so the caller runs large prompts in a worker thread.

    Counting of a prompt stops once it is proven larger than the context window (and no later prompt is
    counted): the work an adversarial body can cause is bounded by the window, not the body size.
    """
    counts: list[Count] = []
    for item in req.prompts:
        counted = prompts.count(item, policy, stop_above=policy.context_window)
        counts.append(counted)
        if not counted.complete:
            break
    return counts


def prompt_token_lower_bound(req: ParsedRequest, policy: ModelPolicy) -> int:
    """The largest single prompt's lower bound, computed without tokenizing (see `prompt.lower_bound`).

    Opaque prompts are left out: their size is unknown, so only the backend can judge their length.
    """
    return max((prompts.lower_bound(p, policy) for p in req.prompts if not p.opaque), default=0)


def prompt_token_upper_bound(req: ParsedRequest, policy: ModelPolicy) -> int:
    """Sum over prompts of a bound never below the exact count (see `prompt.upper_bound`)."""
    return sum(prompts.upper_bound(p, policy) for p in req.prompts)


# ----------------------------------------------------------------------------------------------------
# Reservation


def context_error(req: ParsedRequest, policy: ModelPolicy, prompt: int, completion: int | None) -> NoReturn:
    """OpenAI's context_length_exceeded error; its wording is what clients pattern-match to trim prompts."""
    window = policy.context_window
    what = req.prompt_param
    if completion is None:
        message = (
            f"This model's maximum context length is {window} tokens. However, your {what} resulted in "
            f"{prompt} tokens. Please reduce the length of the {what}."
        )
        param = what
    else:
        message = (
            f"This model's maximum context length is {window} tokens. However, you requested "
            f"{prompt + completion} tokens ({prompt} in the {what}, {completion} in the completion). "
            f"Please reduce the length of the {what} or completion."
        )
        param = what if prompt >= window else req.max_tokens_param
    raise AdmissionError(400, message, code="context_length_exceeded", param=param)


def plan_reservation(req: ParsedRequest, counts: list[Count], policy: ModelPolicy) -> Reservation:
    """Check every prompt against the context window and size the reservation.

    Each sequence needs its prompt plus its completion in KV cache, so the completion reservation is the
    per-sequence bound times the sequences per prompt, summed over prompts. Without an explicit bound the
    backend may generate up to the rest of the context: that is reserved, or (`missing_max_tokens: inject`)
    the policy's default is written into the body and reserved. A prompt is refused only when its count is
    proven too large (`Count.low`); the reservation uses `Count.high`, so it is never below the truth.

    An opaque prompt (its size unknown to the gateway) is reserved as a whole window per sequence family:
    the backend guarantees prompt + completion <= window, and judges the prompt's length itself.
    """
    if len(counts) > req.prompt_count or not counts:
        raise ValueError(f"expected up to {req.prompt_count} prompt counts, got {len(counts)}")
    window = policy.context_window
    requested = req.requested_max_tokens
    pairs = list(zip(counts, req.prompts, strict=False))
    injected: int | None = None
    if req.generates and requested is None and policy.missing_max_tokens is MissingMaxTokens.INJECT:
        # One bound for every prompt of the request, small enough that each prompt still fits the window.
        room = min((window - c.high for c, p in pairs if not p.opaque), default=window)
        injected = max(1, min(policy.default_max_tokens, room))
    prompt_total = 0
    completion_total = 0
    for counted, prompt in pairs:
        if prompt.opaque:
            held_prompt, held_completion = _opaque_share(
                req, window, requested if requested is not None else injected
            )
            prompt_total += held_prompt
            completion_total += held_completion
            continue
        prompt_total += counted.high
        if not req.generates:
            if counted.low > window:
                context_error(req, policy, counted.low, None)
            continue
        if requested is not None:
            if counted.low + requested > window:
                context_error(req, policy, counted.low, requested)
            per_sequence = requested
        else:
            if counted.low >= window:
                context_error(req, policy, counted.low, None)
            per_sequence = injected if injected is not None else max(1, window - counted.low)
        completion_total += per_sequence * req.sequences
    if len(counts) < req.prompt_count:
        raise ValueError("counting stopped early but no prompt exceeded the context window")
    return Reservation(
        prompt_tokens=prompt_total,
        completion_tokens=completion_total,
        injected_max_tokens=injected,
    )


def _opaque_share(req: ParsedRequest, window: int, bound: int | None) -> tuple[int, int]:
    """(prompt, completion) held for an opaque prompt: the worst case over every prompt size p.

    Its sequences hold p + n * min(bound, window - p) tokens; the most is at p = window - bound, i.e.
    window + (n - 1) * bound, split as (window - bound) for the prompt and n * bound for the completions.
    Without a bound (bound = window) that is n whole windows. A pooling prompt holds one window.
    """
    if not req.generates:
        return window, 0
    per_sequence = window if bound is None else min(bound, window)
    return window - per_sequence, per_sequence * req.sequences


# ----------------------------------------------------------------------------------------------------
# Rewriting


def edit_body(req: ParsedRequest, edits: BodyEdits) -> bytes | None:
    """The body re-serialised with `edits` applied, or None when nothing needs to change.

    Other fields are kept as they were; UTF-8 stays unescaped unless a lone surrogate forces escaping. The
    caller must update Content-Length (and, when usage was asked for on the client's behalf, strip the
    usage-only event from the response).
    """
    if not edits:
        return None
    body = dict(req.body)
    if not adapter_for(req.api).edit(req, body, edits):
        return None
    try:
        return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    except UnicodeEncodeError:
        # A lone surrogate (legal as a JSON escape) cannot be written as UTF-8; keep it escaped instead.
        return json.dumps(body, ensure_ascii=True, separators=(",", ":")).encode("ascii")
