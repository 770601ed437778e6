"""What a metered request costs: its prompt's bounds and count, and the reservation it holds while it runs.

The steps after the parse (`request.py`), by cost, so admission can decide as early and as cheaply as
possible:

2. `prompt_token_lower_bound` is arithmetic on byte counts gathered while parsing: a request whose bound
   already exceeds the context window is refused without tokenizing it.
3. `count_prompt_tokens` tokenizes (CPU heavy; tiktoken releases the GIL), stopping once a prompt is
   proven larger than the context window.
4. `plan_reservation` applies the context-window check per prompt and sizes the completion reservation:
   always an upper bound of what the backend may generate.

Each makes the calls it needs of the prompts and reads the parsed request's fields directly, so that a
reservation is sized in one visit here, not in many.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NoReturn

from extproc.admission.intake.request import DEFAULT_STEP_BOUNDS
from extproc.admission.vocabulary import prompt as prompts
from extproc.admission.vocabulary.errors import AdmissionError
from extproc.admission.vocabulary.parsed import ParsedRequest
from extproc.admission.vocabulary.policy import MissingMaxTokens, ModelPolicy, StepBounds
from extproc.admission.vocabulary.prompt import Count


@dataclass(frozen=True, slots=True)
class Reservation:
    """Tokens to hold against the budget while the request runs; settled later against actual usage."""

    prompt_tokens: int  # sum over prompts
    completion_tokens: int  # reserved for output: per-sequence bound x sequences x prompts (0 for pooling)
    # The bound written into the body (missing_max_tokens: inject), None when the body keeps its own.
    injected_max_tokens: int | None = None
    # Of `completion_tokens`, what the request declares it will generate (`min_tokens`, `ignore_eos`): a
    # forecast of its completion never books less.
    committed_completion_tokens: int = 0
    # Each text's tokens of a request's one prompt, counted exactly and kept whole (`Count.texts`); empty on
    # a bound, for several prompts or under truncation: the KV budget's prefix credit in tokens.
    text_tokens: tuple[int, ...] = field(default=(), compare=False)

    @property
    def total(self) -> int:
        return self.prompt_tokens + self.completion_tokens


# ----------------------------------------------------------------------------------------------------
# Counting


def truncation_limit(req: ParsedRequest, policy: ModelPolicy) -> int | None:
    """Tokens vLLM keeps of each prompt under `truncate_prompt_tokens`, None without truncation.

    vLLM v0.32.0 renderers/params.py: a value above the window is refused (`TokenizeParams.__post_init__`);
    -1 keeps the most the window allows, less one token for output when the request generates
    (`max_truncation_tokens`). The prompt is cut before the output bound is computed, so each sequence may
    then generate up to the window less the kept prompt (entrypoints/serve/utils/api_utils.py:169
    `get_max_tokens`).
    """
    limit = req.truncate_prompt_tokens
    if limit is None:
        return None
    window = policy.context_window
    if limit > window:
        raise AdmissionError(
            400,
            f"truncate_prompt_tokens={limit} cannot be greater than max_model_len={window}. Please request a "
            "smaller truncation size.",
            code="invalid_value",
            param="truncate_prompt_tokens",
        )
    if limit < 0:
        return window - 1 if req.generates else window
    return limit


def count_prompt_tokens(req: ParsedRequest, policy: ModelPolicy) -> list[Count]:
    """Tokens of each prompt; CPU heavy, so the caller runs large prompts in a worker thread.

    Counting of a prompt stops once it is proven larger than the context window (and no later prompt is
    counted): the work an adversarial body can cause is bounded by the window, not the body size. Under
    truncation it stops once a prompt is proven longer than what is kept, and goes on to the next prompt:
    a longer prompt is cut, not refused.
    """
    limit = truncation_limit(req, policy)
    counts: list[Count] = []
    for item in req.prompts:
        counted = prompts.count(item, policy, stop_above=policy.context_window if limit is None else limit)
        counts.append(counted)
        if not counted.complete and limit is None:
            break
    return counts


def _kept(counted: Count, limit: int | None) -> Count:
    """A prompt's count after truncation to `limit` tokens (an unfinished count is past the limit)."""
    if limit is None:
        return counted
    if not counted.complete:
        return Count(limit, limit)
    return Count(min(counted.low, limit), min(counted.high, limit))


def prompt_token_lower_bound(req: ParsedRequest, policy: ModelPolicy) -> int:
    """The largest single prompt's lower bound, computed without tokenizing (see `prompt.lower_bound`),
    after truncation.

    Opaque prompts are left out: their size is unknown, so only the backend can judge their length.
    """
    limit = truncation_limit(req, policy)
    lowest = 0
    for prompt in req.prompts:
        if not prompt.opaque:
            lowest = max(lowest, prompts.lower_bound(prompt, policy))
    return lowest if limit is None else min(lowest, limit)


def prompt_token_upper_bound(req: ParsedRequest, policy: ModelPolicy) -> int:
    """Sum over prompts of a bound never below the exact count (see `prompt.upper_bound`), after
    truncation."""
    limit = truncation_limit(req, policy)
    highs = (prompts.upper_bound(p, policy) for p in req.prompts)
    return sum(high if limit is None else min(high, limit) for high in highs)


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


def plan_reservation(
    req: ParsedRequest, counts: list[Count], policy: ModelPolicy, bounds: StepBounds = DEFAULT_STEP_BOUNDS
) -> Reservation:
    """Check every prompt against the context window and size the reservation.

    Each sequence needs its prompt plus its completion in KV cache, so the completion reservation is the
    per-sequence bound times the sequences per prompt, summed over prompts. Without an explicit bound the
    backend may generate up to the rest of the context: that is reserved, or (`missing_max_tokens: inject`)
    the policy's default is written into the body and reserved. A prompt is refused only when its count is
    proven too large (`Count.low`); the reservation uses `Count.high`, so it is never below the truth.
    Under truncation each prompt counts what the backend keeps of it (`truncation_limit`).

    An opaque prompt (its size unknown to the gateway) is reserved as a whole window per sequence family:
    the backend guarantees prompt + completion <= window, and judges the prompt's length itself.
    """
    expected = len(req.prompts)
    if len(counts) > expected or not counts:
        raise ValueError(f"expected up to {expected} prompt counts, got {len(counts)}")
    window = policy.context_window
    limit = truncation_limit(req, policy)
    requested = req.requested_max_tokens
    pairs = [(_kept(c, limit), p) for c, p in zip(counts, req.prompts, strict=False)]
    injected: int | None = None
    if req.generates and requested is None and policy.missing_max_tokens is MissingMaxTokens.INJECT:
        # One bound for every prompt of the request, small enough that each prompt still fits the window,
        # and not below the request's own `min_tokens` (vLLM refuses min_tokens above max_tokens).
        room = min((window - c.high for c, p in pairs if not p.opaque), default=window)
        injected = max(1, min(max(policy.default_max_tokens, req.min_tokens), room))
    prompt_total = 0
    completion_total = 0
    committed = 0
    for counted, prompt in pairs:
        if prompt.opaque:
            held_prompt, held_completion = _opaque_share(
                req, window, requested if requested is not None else injected
            )
            prompt_total += held_prompt
            completion_total += held_completion
            committed += _committed(req, held_completion // max(1, req.sequences))
            continue
        prompt_total += counted.high
        _check_prompt_logprobs(req, counted, bounds)
        if not req.generates:
            if counted.low > window:
                context_error(req, policy, counted.low, None)
            continue
        if requested is not None and limit is not None:
            # vLLM clamps the bound to what the kept prompt leaves (`get_max_tokens`), never refuses it.
            if counted.low >= window:
                context_error(req, policy, counted.low, None)
            per_sequence = min(requested, window - counted.low)
        elif requested is not None:
            if counted.low + requested > window:
                context_error(req, policy, counted.low, requested)
            per_sequence = requested
        else:
            if counted.low >= window:
                context_error(req, policy, counted.low, None)
            per_sequence = injected if injected is not None else max(1, window - counted.low)
        _check_min_tokens(req, per_sequence)
        completion_total += per_sequence * req.sequences
        committed += _committed(req, per_sequence)
    if len(counts) < expected:
        raise ValueError("counting stopped early but no prompt exceeded the context window")
    whole = len(counts) == 1 and limit is None and counts[0].complete
    return Reservation(
        prompt_tokens=prompt_total,
        completion_tokens=completion_total,
        injected_max_tokens=injected,
        committed_completion_tokens=committed,
        text_tokens=counts[0].texts if whole else (),
    )


def _committed(req: ParsedRequest, per_sequence: int) -> int:
    """Completion tokens the request declares it will generate for one prompt, over its sequences: the
    whole bound under `ignore_eos`, else `min_tokens` (vLLM v0.32.0 sampling_params.py: EOS is not a stop
    under `ignore_eos`; `min_tokens` suppresses every stop until that many tokens)."""
    if not req.generates:
        return 0
    floor = per_sequence if req.ignore_eos else min(req.min_tokens, per_sequence)
    return floor * req.sequences


def _check_min_tokens(req: ParsedRequest, per_sequence: int) -> None:
    """vLLM refuses `min_tokens` above the output bound it computed (vLLM v0.32.0 sampling_params.py
    `_verify_args`); so does the gateway, before holding anything."""
    if req.min_tokens > per_sequence:
        raise AdmissionError(
            400,
            f"{req.min_tokens_param} must be less than or equal to max_tokens={per_sequence}, got "
            f"{req.min_tokens}.",
            code="invalid_value",
            param=req.min_tokens_param,
        )


def _check_prompt_logprobs(req: ParsedRequest, counted: Count, bounds: StepBounds) -> None:
    """Prompt logprobs are full-vocabulary logits at every prompt position: bounded by prompt length."""
    if req.work.prompt_logprobs is None or counted.low <= bounds.prompt_logprobs_tokens:
        return
    raise AdmissionError(
        400,
        f"'prompt_logprobs' (also implied by 'echo' with logprobs) is accepted for prompts of at most "
        f"{bounds.prompt_logprobs_tokens} tokens; this prompt has {counted.low}.",
        code="invalid_value",
        param="prompt_logprobs",
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
