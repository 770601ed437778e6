"""A metered request, whatever API it came from: its facts, and how its body may be edited.

The work is split by cost so admission can decide as early and as cheaply as possible. The first step is
here; what the request costs, its prompt's bounds and count and its reservation, is `reservation.py`'s:

1. `parse_request` hands the raw body and its content type to the API's body format (`ApiSpec.body`: JSON
   for every API so far, `extproc/admission/vocabulary/body.py`) and validates the fields that drive
   admission through the API's adapter (its `ApiSpec` in `extproc/admission/apis/`; the types it fills are
   in `extproc/admission/vocabulary/parsed.py`). Nothing here assumes an encoding, so an API with another
   one is its own module alone. It never tokenizes, so it is safe to run on the event loop. A malformed
   request is refused here with the 400 the backend would have returned.

`edit_body` rewrites a request before it goes upstream, in its API's format: ask for usage in a stream (so
settlement is exact), write an output bound (under `missing_max_tokens: inject`), and strip or set the
scheduling priority.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from extproc.admission.apis import USAGE_OPTION_APIS, spec_of
from extproc.admission.vocabulary.errors import AdmissionError
from extproc.admission.vocabulary.parsed import NO_STEP_WORK, Adapter, Api, BodyEdits, ParsedRequest, StepWork
from extproc.admission.vocabulary.policy import StepBounds

__all__ = [
    "ALLOW_STORED_CONTEXT",
    "DEFAULT_STEP_BOUNDS",
    "NO_STEP_WORK",
    "USAGE_OPTION_APIS",
    "Adapter",
    "Api",
    "BodyEdits",
    "ParsedRequest",
    "StepWork",
    "check_step_work",
    "custom_template",
    "edit_body",
    "parse_request",
]

DEFAULT_STEP_BOUNDS = StepBounds()
"""Per-step work bounds when the caller passes none (the `admission.per_step` defaults)."""

ALLOW_STORED_CONTEXT = False
"""Default for requests that prepend a conversation stored on the backend (Responses
`previous_response_id`, SGLang `session_params`): refused, since its size is unknown to the gateway. When
allowed, such a prompt is opaque and charged the whole context window."""


def parse_request(
    api: Api,
    raw: bytes,
    *,
    content_type: str | None = None,
    allow_stored_context: bool = ALLOW_STORED_CONTEXT,
    bounds: StepBounds = DEFAULT_STEP_BOUNDS,
) -> ParsedRequest:
    """Decode and validate a request body; cheap (decoding and field checks only, no tokenizing).

    `raw` is decoded by the API's body format with the request's `content_type` (None: no header), then
    validated by its adapter. Raises AdmissionError(400) naming the offending field. Unknown fields pass
    through untouched. A request that prepends a stored conversation is refused unless
    `allow_stored_context` (see `ALLOW_STORED_CONTEXT`); one that asks for more per-step work than `bounds`
    allow is refused.
    """
    spec = spec_of(api)
    try:
        parsed = spec.adapter.parse(spec.body.decode(raw, content_type))
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
    check_step_work(parsed.work, bounds)
    template = custom_template(parsed.body)
    return parsed if template is None else replace(parsed, custom_template=template)


def custom_template(body: dict[str, Any]) -> str | None:
    """The field of a request-supplied chat template, whatever the API: vLLM renders a top-level
    `chat_template`, and a `chat_template_kwargs.chat_template` too (it is merged into the template call),
    and refuses both unless started with `--trust-request-chat-template` (vLLM v0.32.0
    renderers/online_renderer.py:679-697 `validate_chat_template`, renderers/params.py:136-141)."""
    if body.get("chat_template") is not None:
        return "chat_template"
    kwargs = body.get("chat_template_kwargs")
    if isinstance(kwargs, dict) and kwargs.get("chat_template") is not None:
        return "chat_template_kwargs.chat_template"
    return None


def check_step_work(work: StepWork, bounds: StepBounds) -> None:
    """Refuse per-step work past the configured bounds (`admission.per_step`), naming the field."""
    lists = (
        (work.stop_param, work.stop, bounds.stop),
        ("bad_words", work.bad_words, bounds.bad_words),
        ("logit_bias", work.logit_bias, bounds.logit_bias),
    )
    for name, size, most in lists:
        if size > most:
            raise AdmissionError(
                400,
                f"'{name}' has {size} entries; this gateway accepts at most {most}.",
                code="invalid_value",
                param=name,
            )
    for name, value in ((work.logprobs_param, work.logprobs), ("prompt_logprobs", work.prompt_logprobs)):
        if value is not None and (value < 0 or value > bounds.logprobs):
            asked = "the whole vocabulary" if value < 0 else str(value)
            raise AdmissionError(
                400,
                f"'{name}' asks for {asked} logprobs per token; this gateway accepts at most "
                f"{bounds.logprobs}.",
                code="invalid_value",
                param=name,
            )


# ----------------------------------------------------------------------------------------------------
# Rewriting


def edit_body(req: ParsedRequest, edits: BodyEdits) -> bytes | None:
    """The body re-encoded in its API's format with `edits` applied, or None when nothing needs to change.

    Other fields are kept as they were (JSON: UTF-8 stays unescaped unless a lone surrogate forces
    escaping). The caller must update Content-Length (and, when usage was asked for on the client's behalf,
    strip the usage-only event from the response).
    """
    if not edits:
        return None
    spec = spec_of(req.api)
    body = dict(req.body)
    if not spec.adapter.edit(req, body, edits):
        return None
    return spec.body.encode(body)
