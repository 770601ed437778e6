"""How a finished request is charged: one pure rule for every way a response can end, in every profile.

The inline profile learns the facts from the response messages it sees; the lean profile learns them from
the proxy's end-of-request report. Both hand a `ResponseFacts` to `settle_charge`, so the rules below (and
in docs/architecture.md) hold whichever path delivered them:

| how the request ended                               | ending         | tokens charged                    |
| --------------------------------------------------- | -------------- | --------------------------------- |
| response completed (end of body, trailers, [DONE])  | completed      | reported usage, else prompt +     |
|                                                     |                | counted completion                |
| client disconnect or upstream reset mid-response    | aborted        | prompt + completion streamed, or  |
|                                                     |                | the decode-rate estimate if more  |
| upstream answered >= 400, or sent an error event    | upstream_error | prompt + what was generated       |
| answered by a later proxy filter, never sent to the | not_forwarded  | nothing                           |
| backend (an inference pool's endpoint picker), or   |                |                                   |
| its admission never reached the proxy (the proxy's  |                |                                   |
| message timer fired first: it answered 504 itself)  |                |                                   |
| ended before response headers (client gone, ...)    | aborted        | prompt + estimate of generation   |
| reset by the sidecar under KV pressure              | cut            | prompt + completion streamed      |
| no end signal within the lease's bound (lean)       | expired        | prompt + estimate of generation   |
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from extproc.admission.vocabulary.usage import Usage


class Ending(enum.StrEnum):
    """How a request's response ended; the `outcome` label of `extproc_settlements_total`."""

    COMPLETED = "completed"
    ABORTED = "aborted"
    UPSTREAM_ERROR = "upstream_error"
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
    `NEVER_FORWARDED`), so the engine neither read the prompt nor generated anything.
    """

    upstream_status: int | None = None
    completed: bool = False
    cut: bool = False
    expired: bool = False
    usage: Usage | None = None
    error_seen: bool = False
    estimated_completion: int = 0
    forwarded: bool = True


@dataclass(frozen=True, slots=True)
class Charge:
    """The settlement of one lease: tokens charged, split into prompt and completion, and how it ended."""

    ending: Ending
    prompt: int
    completion: int

    @property
    def total(self) -> int:
        return self.prompt + self.completion


def ending_of(facts: ResponseFacts) -> Ending:
    if facts.cut:
        return Ending.CUT
    if not facts.forwarded:
        return Ending.NOT_FORWARDED
    if (facts.upstream_status is not None and facts.upstream_status >= 400) or facts.error_seen:
        return Ending.UPSTREAM_ERROR
    if facts.completed:
        return Ending.COMPLETED
    if facts.expired:
        return Ending.EXPIRED
    return Ending.ABORTED


def settle_charge(admitted_prompt: int, facts: ResponseFacts) -> Charge:
    """Tokens to charge for a request admitted with `admitted_prompt` prompt tokens, under the rules above."""
    ending = ending_of(facts)
    if ending is Ending.NOT_FORWARDED:
        return Charge(ending=ending, prompt=0, completion=0)
    prompt = admitted_prompt
    completion = 0
    usage = facts.usage
    if usage is not None:
        if usage.reported and usage.prompt_tokens is not None:
            prompt = usage.prompt_tokens
        completion = usage.completion_tokens
    if ending in (Ending.ABORTED, Ending.EXPIRED):
        # The engine's work, not the client's reading: what passed is a floor, the estimate can be more.
        completion = max(completion, facts.estimated_completion)
    return Charge(ending=ending, prompt=max(0, prompt), completion=max(0, completion))
