"""The metered APIs: one `ApiSpec` per API (`spec.py`), each in its API's module, and the registry that
lists them.

An API's spec holds everything the gateway knows about it: its adapter (how a body is validated into a
`ParsedRequest` and how it may be edited), its response dialect (inline profile) and Lua read spec (lean
profile), the error envelope its clients parse, whether its streams report usage only when asked, and the
paths it is served on. Every per-API lookup (`spec_of`, `dialect_for`, `render_refusal`, the metered rows
of `extproc/admission/paths.py`) reads this list; nothing else keeps a table by API.

Adding an API: write its module here ending with its `ApiSpec`, name it in `Api`
(`extproc/admission/parsed.py`), and add the spec to `REGISTRY`; docs/architecture.md walks through it.
"""

from __future__ import annotations

from extproc.admission.apis import (
    anthropic,
    chat,
    chat_batch,
    cohere_embed,
    completions,
    detokenize,
    embeddings,
    invocations,
    pooling,
    responses,
    score,
    sglang,
    sglang_encode,
    token_io,
    tokenize,
)
from extproc.admission.apis.spec import ApiSpec
from extproc.admission.parsed import Adapter, Api
from extproc.admission.usage import Dialect
from extproc.admission.verdicts import Refusal

REGISTRY: tuple[ApiSpec, ...] = (
    chat.CHAT,
    completions.COMPLETIONS,
    embeddings.EMBEDDINGS,
    chat_batch.CHAT_BATCH,
    responses.RESPONSES,
    anthropic.MESSAGES,
    invocations.INVOCATIONS,
    token_io.GENERATE_TOKENS,
    sglang.SGLANG_GENERATE,
    sglang_encode.SGLANG_ENCODE,
    pooling.POOLING,
    score.SCORE,
    cohere_embed.COHERE_EMBED,
    tokenize.TOKENIZE,
    detokenize.DETOKENIZE,
)
"""Every metered API, in the order of the path table's metered rows (docs/admission.md)."""

USAGE_OPTION_APIS = frozenset(spec.api for spec in REGISTRY if spec.usage_option)
"""APIs whose streams report usage only when asked (`stream_options.include_usage`)."""

_BY_API: dict[Api, ApiSpec] = {spec.api: spec for spec in REGISTRY}


def spec_of(api: Api) -> ApiSpec:
    """The spec of a metered API (every `Api` has one: tests/unit/admission/test_paths.py checks it)."""
    return _BY_API[api]


def adapter_for(api: Api) -> Adapter:
    """How the API's bodies are validated and edited."""
    return _BY_API[api].adapter


def dialect_for(api: Api) -> Dialect:
    """How the API's responses carry generated text and usage; a fresh reader for each response."""
    return _BY_API[api].dialect()


def render_refusal(api: Api | None, refusal: Refusal) -> Refusal:
    """A refusal in the error envelope the API's clients parse (status and headers unchanged); OpenAI's
    before the request's API is known."""
    return refusal if api is None else _BY_API[api].render_refusal(refusal)
