"""One adapter per metered API: how its body is validated into a `ParsedRequest` and how it may be edited.

Adding an API is one adapter here plus its row in the path table (`extproc/admission/paths.py`).
"""

from __future__ import annotations

from extproc.admission.apis.openai import ChatAdapter, CompletionsAdapter, EmbeddingsAdapter
from extproc.admission.request import Adapter, Api
from extproc.admission.usage import OPENAI, Dialect

ADAPTERS: dict[Api, Adapter] = {
    Api.CHAT: ChatAdapter(),
    Api.COMPLETIONS: CompletionsAdapter(),
    Api.EMBEDDINGS: EmbeddingsAdapter(),
}

DIALECTS: dict[Api, Dialect] = {
    Api.CHAT: OPENAI,
    Api.COMPLETIONS: OPENAI,
    Api.EMBEDDINGS: OPENAI,
}


def dialect_for(api: Api) -> Dialect:
    """How the API's responses carry generated text and usage."""
    return DIALECTS[api]
