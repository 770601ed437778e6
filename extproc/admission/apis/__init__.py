"""The metered APIs: one `ApiSpec` per API (`spec.py`), each at the end of its API's module as `SPEC`, and
the registry, which finds those modules itself.

An API's spec holds everything the gateway knows about it: its body format (how the raw bytes and their
content type are decoded, JSON unless it says otherwise), its adapter (how the decoded body is validated
into a `ParsedRequest` and how it may be edited, and the API's name), its response dialect (inline
profile) and Lua read spec (lean profile), the error envelope its clients parse, whether its streams report
usage only when asked, and the paths it is served on. Every per-API lookup (`spec_of`, `dialect_for`,
`render_refusal`, the metered rows of `extproc/admission/intake/paths.py`) reads the registry; nothing else
keeps a table by API.

Adding an API is adding its module here, ending with `SPEC = ApiSpec(...)`: the registry imports every
module of this package in name order and lists the `SPEC` of each that has one (the others, `common.py`,
`openai.py`, `spec.py`, hold rules several APIs share). docs/architecture.md walks through it.

Modules, by their path from this folder: one `ApiSpec` module per API, its last line `SPEC = ApiSpec(...)`;
the registry, `__init__.py`, discovers them: `spec.py` (`ApiSpec`: an API's body format, adapter, dialect,
reading spec, refusal renderer, usage option and paths), `chat.py` (OpenAI chat completions), `chat_batch.py`
(vLLM's batch chat completions), `completions.py` (OpenAI completions), `responses.py` (OpenAI Responses),
`embeddings.py` (OpenAI embeddings), `pooling.py` (pooling APIs on OpenAI's input shapes), `score.py` (score
and rerank), `anthropic.py` (Anthropic Messages), `cohere_chat.py` (Cohere chat v2), `cohere_embed.py` (Cohere
embed), `invocations.py` (SageMaker, the API chosen by the body), `token_io.py` (vLLM token-in/token-out
generation), `tokenize.py` and `detokenize.py` (vLLM's tokenizer endpoints), `sglang.py` (SGLang's native
`/generate`), `sglang_encode.py` (SGLang's `/encode` and `/classify`); the rules several share: `openai.py`
(OpenAI's request schema, response dialect and reading spec), `common.py` (small rules of the non-OpenAI
adapters).
"""

from __future__ import annotations

import importlib
import pkgutil
from collections import Counter
from collections.abc import Iterable

from extproc.admission.apis.spec import ApiSpec
from extproc.admission.replies.verdicts import Refusal
from extproc.admission.vocabulary.parsed import Api
from extproc.admission.vocabulary.usage import Dialect


def discover(package: str, folders: Iterable[str]) -> tuple[ApiSpec, ...]:
    """The `SPEC` of every module of `package` (found in `folders`) that has one, in module-name order.

    Import-time checks, so a mistake stops the process before it serves: a `SPEC` that is not an
    `ApiSpec`, two modules declaring one API name, or one path served by two APIs.
    """
    specs: list[ApiSpec] = []
    for name in sorted(info.name for info in pkgutil.iter_modules(list(folders))):
        spec = getattr(importlib.import_module(f"{package}.{name}"), "SPEC", None)
        if spec is None:
            continue  # a module of rules several APIs share
        if not isinstance(spec, ApiSpec):
            raise TypeError(f"{package}.{name}.SPEC is a {type(spec).__name__}, not an ApiSpec")
        specs.append(spec)
    _check_unique("API name", [spec.api for spec in specs])
    _check_unique("path", [row.path for spec in specs for row in spec.paths])
    return tuple(specs)


def _check_unique(what: str, values: list[str]) -> None:
    twice = sorted(value for value, count in Counter(values).items() if count > 1)
    if twice:
        raise ValueError(f"{what} declared by two API modules: {', '.join(twice)}")


REGISTRY: tuple[ApiSpec, ...] = discover(__name__, __path__)
"""Every metered API, in the order of its module's name: the order of the path table's metered rows
(docs/admission.md)."""

USAGE_OPTION_APIS = frozenset(spec.api for spec in REGISTRY if spec.usage_option)
"""APIs whose streams report usage only when asked (`stream_options.include_usage`)."""

_BY_API: dict[Api, ApiSpec] = {spec.api: spec for spec in REGISTRY}


def spec_of(api: Api) -> ApiSpec:
    """The spec of a metered API (every name a request carries comes from a registered adapter)."""
    return _BY_API[api]


def dialect_for(api: Api) -> Dialect:
    """How the API's responses carry generated text and usage; a fresh reader for each response."""
    return _BY_API[api].dialect()


def render_refusal(api: Api | None, refusal: Refusal) -> Refusal:
    """A refusal in the error envelope the API's clients parse (status and headers unchanged); OpenAI's
    before the request's API is known."""
    return refusal if api is None else _BY_API[api].render_refusal(refusal)
