"""`ApiSpec`: everything the gateway knows about one metered API, in one value.

Each API's module under `extproc/admission/apis/` ends with its spec, named `SPEC`; the registry in
`extproc/admission/apis/__init__.py` finds those modules itself, and every table the gateway keeps per API
(adapters, dialects, Lua read specs, error envelopes, the usage option, the metered rows of the path table)
is read from the specs it found. Adding an API is adding its module.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, replace

from extproc.admission.replies.verdicts import Refusal
from extproc.admission.vocabulary.body import JSON_BODY, BodyFormat
from extproc.admission.vocabulary.parsed import Adapter, Api
from extproc.admission.vocabulary.readspec import ReadSpec
from extproc.admission.vocabulary.usage import Dialect

VLLM = "vLLM"
SGLANG = "SGLang"
BOTH = "vLLM, SGLang"

GENERATES = "generates"
REFUSED = "The request was refused by the gateway."
"""A rendered refusal's message when the OpenAI envelope it came in has none."""
PROMPT_ONLY = "runs the model on the prompt; nothing is generated"


@dataclass(frozen=True, slots=True)
class ApiPath:
    """One path an API is served on: a metered row of the path table (`extproc/admission/intake/paths.py`),
    with the reason it is metered and the engines that serve it (both documented in docs/admission.md)."""

    path: str
    reason: str
    engines: str = BOTH
    methods: frozenset[str] = frozenset({"POST"})


def path(path: str, reason: str, engines: str = BOTH, methods: tuple[str, ...] = ("POST",)) -> ApiPath:
    return ApiPath(path, reason, engines, frozenset(methods))


def shared(dialect: Dialect) -> Callable[[], Dialect]:
    """A dialect that keeps no state between events: one reader serves every response."""
    return lambda: dialect


def keep_openai_envelope(refusal: Refusal) -> Refusal:
    """The refusal as it is: OpenAI's error envelope, which every API's clients parse unless they say."""
    return refusal


def refused_message(refusal: Refusal) -> str:
    """The message of a refusal's OpenAI envelope, for an API that renders its own."""
    try:
        found = json.loads(refusal.body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return REFUSED
    return found if isinstance(found, str) else REFUSED


def reenveloped(refusal: Refusal, payload: object) -> Refusal:
    """The same refusal (status and headers kept) with `payload` as its compact ASCII JSON body."""
    body = json.dumps(payload, separators=(",", ":"), ensure_ascii=True).encode("ascii")
    return replace(refusal, body=body)


@dataclass(frozen=True, slots=True)
class ApiSpec:
    """One API: how its request body is decoded from its bytes and content type and written back after
    edits (`body`: JSON unless the API says otherwise), how it is validated and edited (`adapter`, which
    declares the API's name), how its responses carry text and usage inline (`dialect`, a fresh reader per
    response) and in the lean profile (`read`), the error envelope its clients parse (`render_refusal`),
    whether its streams report usage only when asked (`usage_option`: `stream_options.include_usage`, which
    the sidecar may set and strip), and the paths it is served on."""

    adapter: Adapter
    dialect: Callable[[], Dialect]
    read: ReadSpec
    paths: tuple[ApiPath, ...]
    render_refusal: Callable[[Refusal], Refusal] = keep_openai_envelope
    usage_option: bool = False
    body: BodyFormat = JSON_BODY

    @property
    def api(self) -> Api:
        """The API's name, as its adapter declares it (and so as every request it parses names it)."""
        return self.adapter.api
