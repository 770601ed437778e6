"""How a finished request is charged: one pure rule for every way a response can end, in every profile.

The inline profile learns the facts from the response messages it sees; the lean profile learns them from
the proxy's end-of-request report. Both hand a `ResponseFacts` to `settle_charge`, so the rules below (and
in docs/architecture.md) hold whichever path delivered them:

| how the request ended                               | ending         | tokens charged                    |
| --------------------------------------------------- | -------------- | --------------------------------- |
| response completed (end of body, trailers, [DONE])  | completed      | reported usage, else prompt +     |
|                                                     |                | counted completion                |
| client disconnect or upstream reset mid-response    | aborted        | prompt + the engines' count, else |
|                                                     |                | completion streamed, in whole     |
|                                                     |                | steps of all n sequences, or the  |
|                                                     |                | decode-rate estimate if more      |
| the engine refused it: 503, its queue is full       | engine_busy    | nothing                           |
| upstream answered >= 400, or sent an error event    | upstream_error | prompt + what was generated       |
| the proxy could not connect to any engine (Envoy's  | engine_        | nothing                           |
| own 503: UF connection failure, UH no healthy       | unreachable    |                                   |
| upstream), never sent                               |                |                                   |
| answered by a later proxy filter, never sent to the | not_forwarded  | nothing                           |
| backend (an inference pool's endpoint picker), or   |                |                                   |
| its admission never reached the proxy (the proxy's  |                |                                   |
| message timer fired first: it answered 504 itself)  |                |                                   |
| ended before response headers (client gone, ...)    | aborted        | prompt + the engines' count, else |
|                                                     |                | estimate of generation            |
| reset by the sidecar under KV pressure              | cut            | prompt + the engines' count, else |
|                                                     |                | completion streamed, in whole     |
|                                                     |                | steps of all n sequences          |
| no end signal within the lease's bound (lean)       | expired        | prompt + the engines' count, else |
|                                                     |                | estimate of generation            |

The engines' count (`counted_completion`) is what their generation counters, read by the KV feed, grew by
for the request (extproc/core/engine/tally.py), at least what certainly passed: where it is had, it is
the completion charged. The caller drops a count that falls far below what passed (a missed reading) for
the rules above.

Cached prompt tokens: where the engine reports how many prompt tokens its prefix cache served
(`Usage.cached_prompt_tokens`), each is charged `admission.cached_prompt_token_weight` of a token (1.0, the
default, charges them in full). The discount is rounded down, so a charge never falls below the weighted
count; the hit is clamped to the prompt charged. Admission reserved the whole prompt (the hit is known only
from the answer), so the settlement's refund returns the discount and the ledger (reserved - refunded +
overrun = settled) stays exact.

An engine's 503 is backpressure, not a failure: vLLM answers it before the request enters its scheduler
(`AsyncLLM.check_admission`, vllm 0.32.0 vllm/v1/engine/async_llm.py: `QueueOverflowError` past
`--max-num-queued-reqs`, `MaxQueuedTokensError` past `--max-num-queued-tokens`, both 503 by
vllm/exceptions.py), and Dynamo's frontend sheds load with a 503 when every worker is busy, so the engine read
nothing and the whole reservation goes back. Only a 503 the engine itself sent counts: Envoy's own 503s
(no healthy upstream, overflow, a connection failure, a reset before the response) are told apart by the
profile that reads the response (`engine_answered`).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from extproc.admission.vocabulary.usage import Usage

ENGINE_BUSY_STATUSES = frozenset({503})
"""The statuses an engine refuses with when its queue is full (see the module docstring). Not 529: Dynamo's
load-shedding docs (docs/fault_tolerance/request_rejection.md) answer 503, and no 529 could be found in its
source to confirm, so a 529 keeps the backend-error rule."""


class Ending(enum.StrEnum):
    """How a request's response ended; the `outcome` label of `extproc_settlements_total`."""

    COMPLETED = "completed"
    ABORTED = "aborted"
    ENGINE_BUSY = "engine_busy"
    UPSTREAM_ERROR = "upstream_error"
    ENGINE_UNREACHABLE = "engine_unreachable"
    NOT_FORWARDED = "not_forwarded"
    CUT = "cut"
    EXPIRED = "expired"


@dataclass(frozen=True, slots=True)
class ResponseFacts:
    """What is known about a request's response when it is settled.

    `upstream_status` is None when no response headers arrived. `completed` means the end of the response
    was seen. `estimated_completion` is the bound used when the backend may have generated tokens nobody
    saw (ended before headers, an expired lease, or a stream cut before its end: a slow reader reads less
    than the engine generated): the caller derives it from elapsed time and the pool's observed decode
    rate, capped by the reservation, and sets it only where it applies. `forwarded` is False when the
    request never reached the backend: a filter after the sidecar answered it locally (an endpoint picker's
    429 or 503), or the proxy never had the admission (extproc/admission/tracking/inflight.py
    `NEVER_FORWARDED`), so the engine neither read the prompt nor generated anything. `engine_answered` is
    False when the proxy made the status itself after the request went upstream (the lean profile's access log
    says so: Envoy's response code details other than `via_upstream`, a reset before the response), so a
    503 then is no engine's refusal. `counted_completion` is the engines' own count of the completion where
    the feed had it (see the module docstring): where set, the charge of an aborted, expired or cut answer.
    `engine_unreachable` says the proxy made the answer because it could not connect to any engine (Envoy's
    response flags UF or UH; the inline profile reads them as a response attribute, the lean one from the
    access log): with `forwarded` False, the request is settled as the engine's outage, not as a filter's.
    """

    upstream_status: int | None = None
    completed: bool = False
    cut: bool = False
    expired: bool = False
    usage: Usage | None = None
    error_seen: bool = False
    estimated_completion: int = 0
    counted_completion: int | None = None
    forwarded: bool = True
    engine_answered: bool = True
    engine_unreachable: bool = False

    @property
    def engine_busy(self) -> bool:
        """The engine itself refused the request for want of room (see the module docstring)."""
        return (
            self.forwarded
            and self.engine_answered
            and not self.cut
            and self.upstream_status in ENGINE_BUSY_STATUSES
        )


@dataclass(frozen=True, slots=True)
class Charge:
    """The settlement of one lease: tokens charged, split into prompt and completion, and how it ended.

    `prompt` is the prompt as charged (cached tokens at their weight); `cached` the prompt tokens the engine
    reported served from its prefix cache (0 when it did not say), counted whole for the metrics.
    """

    ending: Ending
    prompt: int
    completion: int
    cached: int = 0

    @property
    def total(self) -> int:
        return self.prompt + self.completion


def ending_of(facts: ResponseFacts) -> Ending:
    if facts.cut:
        return Ending.CUT
    if not facts.forwarded:
        return Ending.ENGINE_UNREACHABLE if facts.engine_unreachable else Ending.NOT_FORWARDED
    if facts.engine_busy:
        return Ending.ENGINE_BUSY
    if (facts.upstream_status is not None and facts.upstream_status >= 400) or facts.error_seen:
        return Ending.UPSTREAM_ERROR
    if facts.completed:
        return Ending.COMPLETED
    if facts.expired:
        return Ending.EXPIRED
    return Ending.ABORTED


def settle_charge(admitted_prompt: int, facts: ResponseFacts, cached_weight: float = 1.0) -> Charge:
    """Tokens to charge for a request admitted with `admitted_prompt` prompt tokens, under the rules above;
    `cached_weight` is what a prompt token served from the prefix cache costs (1.0: full price)."""
    ending = ending_of(facts)
    if ending in (Ending.NOT_FORWARDED, Ending.ENGINE_BUSY, Ending.ENGINE_UNREACHABLE):
        return Charge(ending=ending, prompt=0, completion=0)
    prompt = admitted_prompt
    completion = 0
    cached = 0
    usage = facts.usage
    if usage is not None:
        if usage.reported and usage.prompt_tokens is not None:
            prompt = usage.prompt_tokens
        completion = usage.completion_tokens
        cached = usage.cached_prompt_tokens or 0
    if ending in (Ending.ABORTED, Ending.EXPIRED, Ending.CUT):
        # The engine's work, not the client's reading: its own count where the feed had it; else what
        # passed is a floor, the estimate can be more.
        counted = facts.counted_completion
        completion = counted if counted is not None else max(completion, facts.estimated_completion)
    prompt = max(0, prompt)
    cached = min(cached, prompt)
    charged = prompt - cached_discount(cached, cached_weight)
    return Charge(ending=ending, prompt=charged, completion=max(0, completion), cached=cached)


def cached_discount(cached: int, weight: float) -> int:
    """Tokens taken off the prompt's charge for `cached` prefix-cache hits at `weight`, rounded down so the
    charge never undercuts the weighted count (with weight 1.0, nothing)."""
    if weight >= 1.0 or cached <= 0:
        return 0
    return math.floor(cached * (1.0 - weight) + 1e-9)
