"""A request body resolved before anything is counted: parsed, its model's policy and pools, and what needs
no count refused.

    parse (a large body in a worker thread, through the client's tokenizer lane)
        ─▶ the requested model's policy and pools (404 for a model nobody serves)
        ─▶ refuse a request-supplied chat template, and a prompt whose cheap lower bound is past the window

`resolve` returns one value, `Resolved`, the facts every try of the decision (decision.py) starts from;
`check` refuses what needs no count. Two calls, so that a refusal by `check` is counted under the model it
names (the decision learns the model's label in between).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from extproc.admission.intake.request import Api, ParsedRequest, parse_request
from extproc.admission.intake.reservation import prompt_token_lower_bound
from extproc.admission.intake.rules import DEFAULT_MODEL, AdmissionRules
from extproc.admission.service import AdmissionService
from extproc.admission.vocabulary.errors import AdmissionError
from extproc.admission.vocabulary.policy import ModelPolicy
from extproc.core.kv.budget import KvBudget

OFF_LOOP_PARSE_BYTES = 64 * 1024
"""A request body larger than this is parsed in a worker thread (with its tokenizing), not on the loop."""


@dataclass(frozen=True, slots=True)
class Resolved:
    """A parsed request and the model it resolved to: its policy, the pool whose engines serve it (its KV
    usage and decode pace) and the KV budget that books it (None: none), the pool whose `model:<pool>`
    limits apply, and the label its metrics carry. The budget is the engine's where the picker named one the
    feed knows (`budget_key` then names that engine's, `pool@endpoint`), else the pool's (`budget_key` is
    `pool`)."""

    parsed: ParsedRequest
    policy: ModelPolicy
    pool: str
    budget: KvBudget | None
    limit_pool: str
    model_label: str
    budget_key: str


async def resolve(
    service: AdmissionService,
    api: Api,
    raw: bytes,
    rules: AdmissionRules,
    lane: str,
    content_type: str | None = None,
    endpoint: str | None = None,
) -> Resolved:
    """Parse `raw` (in its API's format, which reads the request's `content_type`), and resolve the requested
    model to its policy, pools and KV budget (404 for a model nobody serves), under the one `rules` the
    decision reads. The engines' pool is the limits' pool, except for a name the config does not know, which
    shares the `models."*"` limits (a client must not mint limits by inventing names) but whose engines the
    feed reports by that name: their budget applies to it (else a config that names no model would run
    without any KV budget). A request whose picker named its engine (`endpoint`) is booked on that engine's
    budget where the feed knows it."""
    parse = functools.partial(
        parse_request,
        content_type=content_type,
        allow_stored_context=rules.allow_stored_context,
        bounds=rules.per_step,
    )
    if len(raw) > OFF_LOOP_PARSE_BYTES:
        # A large body can hold tens of thousands of small messages: parsing it takes tens of ms, on a
        # worker thread, through the client's lane like its counting.
        parsed = await service.lanes.run(lane, len(raw), parse, api, raw)
    else:
        parsed = parse(api, raw)
    deps = service.deps
    served_as = deps.served_as(parsed.model, rules)
    policy = rules.model_policy(served_as) if served_as is not None else None
    if served_as is None or policy is None:
        raise AdmissionError(
            404, f"The model `{parsed.model}` does not exist.", code="model_not_found", param="model"
        )
    limit_pool = rules.pool_of(served_as)
    pool = limit_pool
    if limit_pool == DEFAULT_MODEL and deps.feeds_pool(served_as):
        pool = served_as
    # The engine's budget where the picker named one the feed knows; else the pool's (no picker, or an
    # engine the feed has not read: the pool's budget holds every engine's KV, so it is the safe reading).
    key, budget = pool, deps.kv_budget(pool)
    if endpoint is not None and budget is not None:
        picked = deps.endpoint_budget(pool, endpoint)
        if picked is None:
            label = rules.model_label(limit_pool)
            service.child(service.metrics.picked_engine_unread, label).inc()
        key, budget = picked or (key, budget)
    return Resolved(parsed, policy, pool, budget, limit_pool, rules.model_label(limit_pool), key)


def check(resolved: Resolved, rules: AdmissionRules) -> None:
    """Refuse what needs no count: a request-supplied chat template, unless the operator trusts clients with
    it (`admission.allow_request_chat_template`: one can expand a small body into a huge prompt); a prompt
    whose cheap lower bound is already past the context window."""
    parsed, policy = resolved.parsed, resolved.policy
    key = parsed.custom_template
    if key is not None and not rules.allow_request_chat_template:
        raise AdmissionError(
            400,
            f"'{key}' is not accepted by this gateway; the server's own chat template is used.",
            code="unsupported_parameter",
            param=key,
        )
    lower = prompt_token_lower_bound(parsed, policy)
    if lower >= policy.context_window + (0 if parsed.generates else 1):
        raise AdmissionError(
            400,
            f"This model's maximum context length is {policy.context_window} tokens. However, your "
            f"request has at least {lower} input tokens. Please reduce the length of the input.",
            code="context_length_exceeded",
            param=parsed.prompt_param,
        )
