"""SGLang's native `/encode` and `/classify` (embeddings and reward scores): `sglang.py`'s request shape
with nothing generated, and its `meta_info` dialect.
"""

from __future__ import annotations

from typing import Any

from extproc.admission.apis.common import UNNAMED_MODEL
from extproc.admission.apis.openai import edit_priority
from extproc.admission.apis.sglang import SGLANG_SPEC, SGLangDialect, native_prompts
from extproc.admission.apis.spec import PROMPT_ONLY, SGLANG, ApiSpec, path
from extproc.admission.vocabulary.parsed import Api, BodyEdits, ParsedRequest


class SGLangEncodeAdapter:
    """`/encode` and SGLang's `/classify`: embeddings and reward scores, prompt tokens only."""

    api = Api("sglang_encode")

    def parse(self, body: dict[str, Any]) -> ParsedRequest:
        found, param = native_prompts(body, encode=True)
        return ParsedRequest(
            api=self.api,
            model=UNNAMED_MODEL,
            prompts=found,
            prompt_param=param,
            generates=False,
            body=body,
        )

    def edit(self, req: ParsedRequest, body: dict[str, Any], edits: BodyEdits) -> bool:
        return edit_priority(body, edits)


SPEC = ApiSpec(
    adapter=SGLangEncodeAdapter(),
    dialect=SGLangDialect,
    read=SGLANG_SPEC,
    paths=(path("/encode", PROMPT_ONLY, SGLANG, ("POST", "PUT")),),
)
