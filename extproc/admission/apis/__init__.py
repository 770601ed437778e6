"""One adapter per metered API: how its body is validated into a `ParsedRequest` and how it may be edited;
one dialect per API: how its responses carry generated text and usage.

Adding an API is one adapter here, its dialect, and its row in the path table (`extproc/admission/paths.py`).
"""

from __future__ import annotations

from collections.abc import Callable

from extproc.admission.apis.anthropic import MESSAGES, MessagesAdapter, anthropic_refusal
from extproc.admission.apis.chat_batch import ChatBatchAdapter
from extproc.admission.apis.invocations import InvocationsAdapter
from extproc.admission.apis.openai import ChatAdapter, CompletionsAdapter, EmbeddingsAdapter
from extproc.admission.apis.pooling import (
    COHERE,
    TOKENIZE,
    CohereEmbedAdapter,
    DetokenizeAdapter,
    PoolingAdapter,
    ScoreAdapter,
    TokenizeAdapter,
)
from extproc.admission.apis.responses import RESPONSES, ResponsesAdapter
from extproc.admission.apis.sglang import SGLangDialect, SGLangEncodeAdapter, SGLangGenerateAdapter
from extproc.admission.apis.token_io import TOKEN_IDS, GenerateTokensAdapter
from extproc.admission.request import Adapter, Api
from extproc.admission.usage import OPENAI, Dialect
from extproc.admission.verdicts import Refusal

ADAPTERS: dict[Api, Adapter] = {
    Api.CHAT: ChatAdapter(),
    Api.COMPLETIONS: CompletionsAdapter(),
    Api.EMBEDDINGS: EmbeddingsAdapter(),
    Api.CHAT_BATCH: ChatBatchAdapter(),
    Api.RESPONSES: ResponsesAdapter(),
    Api.MESSAGES: MessagesAdapter(),
    Api.INVOCATIONS: InvocationsAdapter(),
    Api.GENERATE_TOKENS: GenerateTokensAdapter(),
    Api.SGLANG_GENERATE: SGLangGenerateAdapter(),
    Api.SGLANG_ENCODE: SGLangEncodeAdapter(),
    Api.POOLING: PoolingAdapter(),
    Api.SCORE: ScoreAdapter(),
    Api.COHERE_EMBED: CohereEmbedAdapter(),
    Api.TOKENIZE: TokenizeAdapter(),
    Api.DETOKENIZE: DetokenizeAdapter(),
}


def _shared(dialect: Dialect) -> Callable[[], Dialect]:
    return lambda: dialect


DIALECTS: dict[Api, Callable[[], Dialect]] = {
    Api.CHAT: _shared(OPENAI),
    Api.COMPLETIONS: _shared(OPENAI),
    Api.EMBEDDINGS: _shared(OPENAI),
    Api.CHAT_BATCH: _shared(OPENAI),
    Api.RESPONSES: _shared(RESPONSES),
    Api.MESSAGES: _shared(MESSAGES),
    # A parsed /invocations request names the API it resolved to; this entry is never used for it.
    Api.INVOCATIONS: _shared(OPENAI),
    Api.GENERATE_TOKENS: _shared(TOKEN_IDS),
    Api.SGLANG_GENERATE: SGLangDialect,
    Api.SGLANG_ENCODE: SGLangDialect,
    Api.POOLING: _shared(OPENAI),
    Api.SCORE: _shared(OPENAI),
    Api.COHERE_EMBED: _shared(COHERE),
    Api.TOKENIZE: _shared(TOKENIZE),
    Api.DETOKENIZE: _shared(OPENAI),
}
"""A dialect per API, made per response: most are stateless and shared, SGLang's sums per-request counts."""


def dialect_for(api: Api) -> Dialect:
    """How the API's responses carry generated text and usage; a fresh reader for each response."""
    return DIALECTS[api]()


REFUSAL_RENDERERS: dict[Api, Callable[[Refusal], Refusal]] = {
    Api.MESSAGES: anthropic_refusal,
}
"""APIs whose clients expect another error envelope than OpenAI's; every other API keeps OpenAI's."""


def render_refusal(api: Api | None, refusal: Refusal) -> Refusal:
    """A refusal in the error envelope the API's clients parse (status and headers unchanged)."""
    render = REFUSAL_RENDERERS.get(api) if api is not None else None
    return refusal if render is None else render(refusal)
