"""Every refusal the sidecar sends, built in one place: status, OpenAI error JSON, headers and reason.

A client sees the same error envelope whatever refused it (validation, a limit, the KV budget, a queue, the
store), with the headers its SDK reads to back off. A 429's `type` says which kind of limit refused it, as
OpenAI's do: `requests` (a slot, a queue, a deadline), `tokens` (tokens per minute) or `kv_cache` (the KV
budget). Every 429 carries the `x-ratelimit-*` headers of the request's keys where the limiter's view of
them is at hand, as OpenAI sends them on each. Messages say which limit was hit (requests or tokens, gateway,
model or tenant) but never name an internal limiter key or a tenant id: a client learns nothing about other
tenants or how limits are keyed.
"""

from __future__ import annotations

from extproc.admission.replies.headers import format_duration, ratelimit_headers, retry_headers
from extproc.admission.replies.verdicts import Header, Refusal
from extproc.admission.vocabulary.errors import (
    KV_CACHE_LIMIT,
    RATE_LIMIT_EXCEEDED,
    REQUESTS_LIMIT,
    TOKENS_LIMIT,
    AdmissionError,
    error_body,
)
from extproc.admission.vocabulary.names import DETAILS_PREFIX
from extproc.core.kv.budget import KvBudget
from extproc.core.limiter.limiter import RateLimitStatus, Reason, Rejection
from extproc.core.limiter.split import INPUT_PREFIX, base_key
from extproc.core.queue.slot_eta import hint_within

KV_RETRY_AFTER_S = 1.0
"""Retry hint for a KV-budget refusal while the pool's decode pace is unknown (no forecast of when the
running sequences end)."""

STORE_RETRY_AFTER_S = 1.0
"""Retry hint while the shared limiter store is unreachable (fail-closed mode)."""

ENGINE_DOWN = "engine_down"
"""The reason of a refusal because no engine of the pool can be reached (metric label,
`x-extproc-reject-reason`), whether the sidecar refused it up front or Envoy failed to connect."""

ENGINE_DOWN_RETRY_MIN_S = 1.0
ENGINE_DOWN_RETRY_MAX_S = 10.0
ENGINE_DOWN_RETRY_SHARE = 0.25
"""`engine_down_retry_after`: a quarter of the outage so far, between 1 s and 10 s."""

REASON_HEADER = "x-extproc-reject-reason"


def _reason(reason: str, headers: tuple[Header, ...] = ()) -> tuple[Header, ...]:
    return (*headers, (REASON_HEADER, reason))


def invalid(exc: AdmissionError) -> Refusal:
    """A request the backend would refuse too (400, 404, 413): not retryable as is."""
    reason = exc.code or f"http_{exc.status}"
    return Refusal(exc.status, exc.body(), reason, details=f"{DETAILS_PREFIX}{exc.code or exc.status}")


BODY_TOO_LARGE = "The request body is larger than the gateway accepts"
"""How every 413 begins, the sidecar's (`too_large`) and Envoy's (its local-reply mapper in envoy/envoy.yaml,
`envoy_too_large`); each goes on to name the bound that refused the body."""


def too_large_message(size: int, cap: int) -> str:
    """The sidecar's 413: the body's size and the limit it is over (`admission.max_body_bytes`)."""
    return f"{BODY_TOO_LARGE}: {size} bytes, over its limit of {cap} bytes."


def envoy_too_large_message(bound: int) -> str:
    """Envoy's own 413, past the most it buffers for the sidecar (12 MiB in the shipped configs): Envoy never
    counted the body, so it names the bound the body is over."""
    return f"{BODY_TOO_LARGE}: over {bound} bytes, the most the gateway reads."


def too_large(size: int, cap: int) -> Refusal:
    return invalid(
        AdmissionError(
            413,
            too_large_message(size, cap),
            code="request_too_large",
            param=None,
        )
    )


def empty_body() -> Refusal:
    return invalid(
        AdmissionError(400, "The request body is empty; a JSON object is required.", code="invalid_json")
    )


def unknown_path(method: str, path: str) -> Refusal:
    """Deny by default: a path that is neither metered nor on the free list never reaches the backend."""
    shown = path if len(path) <= 200 else path[:200] + "..."
    return invalid(
        AdmissionError(
            404,
            f"Invalid URL ({method.upper()} {shown}): this gateway does not serve it.",
            code="unknown_url",
        )
    )


def scope_of(key: str) -> str:
    """What a limiter key limits, in words a client may see (never the key or tenant id itself); a split
    limit's key (`input:<key>`, `output:<key>`) limits what its key does."""
    key = base_key(key)
    if key.startswith("tenant:"):
        return "your organization"
    if key.startswith("model:"):
        return "this model"
    return "this gateway"


def rate_limited(rejection: Rejection, model: str, requested: int) -> Refusal:
    """429 for a limiter refusal: concurrency, tokens per minute, or a request larger than the bucket."""
    status = rejection.status
    scope = scope_of(rejection.key)
    wait = format_duration(rejection.retry_after_s or 0)
    if rejection.reason is Reason.CONCURRENCY:
        kind = REQUESTS_LIMIT
        message = (
            f"Rate limit reached for {model} on concurrent requests for {scope}: "
            f"Limit {status.limit_requests}. Please try again in {wait}."
        )
    elif rejection.reason is Reason.TOKENS:
        kind = TOKENS_LIMIT
        message = (
            f"Rate limit reached for {model} on tokens per min (TPM) for {scope}: "
            f"Limit {status.limit_tokens}, Remaining {status.remaining_tokens}, Requested {requested}. "
            f"Please try again in {wait}."
        )
    elif rejection.reason in (Reason.INPUT_TOKENS, Reason.OUTPUT_TOKENS):
        kind = TOKENS_LIMIT
        which = "input" if rejection.reason is Reason.INPUT_TOKENS else "output"
        message = (
            f"Rate limit reached for {model} on {which} tokens per min for {scope}. "
            f"Please try again in {wait}."
        )
    elif rejection.key != base_key(rejection.key):  # larger than a split limit
        kind = TOKENS_LIMIT
        which = "input" if rejection.key.startswith(INPUT_PREFIX) else "output"
        message = (
            f"Request too large for {model} on {which} tokens per min for {scope}. "
            "Reduce the prompt or max_tokens; retrying cannot succeed."
        )
    else:
        kind = TOKENS_LIMIT
        message = (
            f"Request too large for {model} on tokens per min (TPM) for {scope}: "
            f"Limit {status.limit_tokens}, Requested {requested}. "
            "Reduce the prompt or max_tokens; retrying cannot succeed."
        )
    headers = (*retry_headers(rejection.retry_after_s), *ratelimit_headers(status))
    reason = rejection.reason.value
    body = error_body(message, type=kind, code=RATE_LIMIT_EXCEEDED)
    return Refusal(429, body, reason, _reason(reason, headers), f"{DETAILS_PREFIX}rate_limited_{reason}")


def kv_retry_after(budget: KvBudget, now: float) -> float:
    """A KV-budget refusal's `retry-after`: when the request just refused is expected to fit, after the
    releases the forecast sees and the places promised to the clients refused before it
    (`KvBudget.retry_after`, extproc/core/kv/schedule.py), so a burst comes back in waves the cache holds;
    at least the fixed second, at most what SDKs honour. A fixed second alone would spend an SDK's two
    default retries within two seconds while the admitted answers run for ten."""
    eta = budget.retry_after(now)
    # Never sooner than the fixed second: a forecast that says "now" for a request it just refused is wrong
    # (a pace learned at a smaller batch, leases taken for finished), and clients following it would spend
    # their retries in a few hundred milliseconds (measured on vLLM: hints of 50 ms).
    return hint_within(eta, KV_RETRY_AFTER_S)


def kv_budget(
    model: str,
    needed: int,
    headroom: int,
    retry_after_s: float = KV_RETRY_AFTER_S,
    status: RateLimitStatus | None = None,
) -> Refusal:
    """The pool's KV cache cannot take this request's footprint now; sequences finishing will free it.

    Typed `kv_cache`, not `tokens`: no tokens-per-minute limit refused it (`KV_CACHE_LIMIT`). `status` is the
    limiter's view of the request's keys: its `x-ratelimit-*` headers go with the refusal as with a slot or
    token refusal, since OpenAI sends them on every 429 and clients read them off whichever 429 they get;
    None (no view at hand) sends the retry headers alone."""
    message = (
        f"The KV cache of {model} is at its admission target: this request needs up to {needed} tokens of "
        f"KV cache and {max(0, headroom)} are available. "
        f"Please try again in {format_duration(retry_after_s)}."
    )
    body = error_body(message, type=KV_CACHE_LIMIT, code=RATE_LIMIT_EXCEEDED)
    headers = _reason("kv_budget", (*retry_headers(retry_after_s), *_limits(status)))
    return Refusal(429, body, "kv_budget", headers, DETAILS_PREFIX + "rate_limited_kv_budget")


def _limits(status: RateLimitStatus | None) -> tuple[Header, ...]:
    """A 429's `x-ratelimit-*` headers from the limiter's view of the request's keys (`status`), on every
    429 as OpenAI sends them, since clients read them off whichever 429 they get; none where there is no
    view at hand (the store could not say)."""
    return ratelimit_headers(status) if status is not None else ()


def queue_refused(
    reason: str,
    class_name: str,
    max_wait_s: float,
    status: RateLimitStatus | None = None,
    drains_in_s: float | None = None,
) -> Refusal:
    """A class that queues found its queue full, or its line ahead of the request too long to drain within
    its wait (`drains_in_s`: when it is expected to have, the retry-after), or waited until its deadline.
    `status`: the limiter's view of its keys (`x-ratelimit-*`)."""
    if drains_in_s is not None:
        why = f"the requests ahead are expected to take {format_duration(drains_in_s)}"
    else:
        why = "the wait queue is full" if reason == "queue_full" else "waited until the deadline"
    message = f"No capacity for class {class_name} within {max_wait_s:g}s ({why}). Please try again later."
    body = error_body(message, type=REQUESTS_LIMIT, code=RATE_LIMIT_EXCEEDED)
    wait = max(1.0, max_wait_s / 2 if drains_in_s is None else drains_in_s)
    headers = _reason(reason, (*retry_headers(wait), *_limits(status)))
    return Refusal(429, body, reason, headers, f"{DETAILS_PREFIX}rate_limited_{reason}")


DEADLINE_UNMET = "deadline_unmet"
"""The reason of every refusal a client's own deadline caused (metric label, `x-extproc-reject-reason`)."""


def deadline_unmet(
    class_name: str, deadline_ms: int, retry_after_s: float | None, status: RateLimitStatus | None = None
) -> Refusal:
    """A request whose deadline for its first token the queue cannot meet: refused at once when the
    capacity it waits for is not expected to free in time, or when its deadline passes while it waits.
    Retryable: the same request without (or with a later) deadline may wait, or fit later. `status`: the
    limiter's view of its keys (`x-ratelimit-*`)."""
    wait = hint_within(retry_after_s, 1.0)
    message = (
        f"No capacity for class {class_name} within this request's deadline of {deadline_ms} ms for its "
        f"first token: the deadline could not be met. Please try again in {format_duration(wait)}."
    )
    body = error_body(message, type=REQUESTS_LIMIT, code=RATE_LIMIT_EXCEEDED)
    headers = _reason(DEADLINE_UNMET, (*retry_headers(wait), *_limits(status)))
    return Refusal(429, body, DEADLINE_UNMET, headers, f"{DETAILS_PREFIX}rate_limited_{DEADLINE_UNMET}")


def tokenizer_busy(retry_after_s: float, status: RateLimitStatus | None = None) -> Refusal:
    """The client's large prompts already waiting to be counted would not let this one start in time: come
    back when its lane is forecast to have drained (`lanes.py` `Lanes.drained_in_s`). `status`: the
    limiter's view of its keys (`x-ratelimit-*`)."""
    body = error_body(
        "Too many large prompts from this client are being processed. Please try again in "
        f"{format_duration(retry_after_s)}.",
        type=REQUESTS_LIMIT,
        code=RATE_LIMIT_EXCEEDED,
    )
    headers = _reason("tokenizer_busy", (*retry_headers(retry_after_s), *_limits(status)))
    return Refusal(429, body, "tokenizer_busy", headers, DETAILS_PREFIX + "rate_limited_tokenizer_busy")


def store_unavailable() -> Refusal:
    """The shared limiter store is down and configured to fail closed (`store.on_unavailable: reject`)."""
    body = error_body(
        "The gateway cannot check its rate limits right now. Please try again shortly.",
        type="server_error",
        code="service_unavailable",
    )
    headers = _reason("store_unavailable", retry_headers(STORE_RETRY_AFTER_S))
    return Refusal(503, body, "store_unavailable", headers, DETAILS_PREFIX + "store_unavailable")


def engine_busy_headers(retry_after_s: float) -> tuple[Header, ...]:
    """Added to an engine's own refusal (a 503, its queue full) as it passes the inline profile: the
    engine's OpenAI-shaped body stays, the headers make it the retryable refusal the sidecar's own are."""
    return _reason("engine_busy", retry_headers(retry_after_s))


def engine_busy(retry_after_s: float, ratelimit: tuple[Header, ...] = ()) -> Refusal:
    """An engine's 503 whose body its clients could not parse (not JSON), answered in its place: the same
    status and hint, in the error envelope the sidecar's own refusals use."""
    message = (
        "The model's engines are at capacity and cannot accept new requests. "
        f"Please try again in {format_duration(retry_after_s)}."
    )
    body = error_body(message, type="server_error", code="service_unavailable")
    headers = _reason("engine_busy", (*retry_headers(retry_after_s), *ratelimit))
    return Refusal(503, body, "engine_busy", headers, DETAILS_PREFIX + "engine_busy")


def engine_down_retry_after(down_for_s: float | None) -> float:
    """The `retry-after` of a refusal while no engine of the pool can be reached, from how long that has
    lasted (`down_for_s`; None: not known to be down, the proxy's first failed connection): a quarter of it,
    at least 1 s, at most 10 s.

    Why a share of the outage: how long it has lasted is the only forecast there is, and an outage grows
    more likely to go on the longer it has (a process restarting comes back in seconds; an engine reloading
    its weights, or a node lost, takes minutes), so clients back off as it drags on and, told a quarter, come
    back about four times over what remains of it instead of spending their retries (the `openai` SDK's two)
    in its first seconds. Why 1 s at least: a client told "now" spends its retries at once. Why 10 s at
    most: once an engine answers again the sidecar admits within its next feed sample, and a client's wait
    past the return is at most this bound; the SDKs honour hints up to 60 s, but an outage's end is not
    forecast, only noticed."""
    if down_for_s is None:
        return ENGINE_DOWN_RETRY_MIN_S
    share = max(0.0, down_for_s) * ENGINE_DOWN_RETRY_SHARE
    return min(ENGINE_DOWN_RETRY_MAX_S, max(ENGINE_DOWN_RETRY_MIN_S, share))


def engine_down_headers(retry_after_s: float) -> tuple[Header, ...]:
    """The reason and retry hint of an engine-down refusal, as the inline profile adds them to a reply the
    proxy made itself when it could not connect to any engine."""
    return _reason(ENGINE_DOWN, retry_headers(retry_after_s))


def engine_down(model: str, retry_after_s: float) -> Refusal:
    """No engine serving `model` can be reached: every endpoint the KV feed knows for its pool refuses
    connections (refused up front, before anything is counted or reserved), or the proxy just failed to
    connect to one for an admitted request. A retryable 503, apart from the gateway's own troubles by its
    code (`engine_unavailable`, where the sidecar or its store away is `service_unavailable`) and its reason;
    `type` stays `server_error`, OpenAI's for every 5xx, which clients bucket errors by."""
    message = (
        f"The engines serving {model} cannot be reached right now (none accepts connections). "
        f"Please try again in {format_duration(retry_after_s)}."
    )
    body = error_body(message, type="server_error", code="engine_unavailable")
    return Refusal(503, body, ENGINE_DOWN, engine_down_headers(retry_after_s), DETAILS_PREFIX + ENGINE_DOWN)


def cut_under_kv_pressure() -> Refusal:
    """Reset an in-flight stream: the backend frees the sequence's KV blocks; lower classes go first."""
    body = error_body(
        "The request was stopped to relieve KV-cache pressure; lower-priority work is shed first.",
        type="server_error",
        code="overloaded",
    )
    return Refusal(503, body, "cut", details=DETAILS_PREFIX + "cut_under_kv_pressure")
