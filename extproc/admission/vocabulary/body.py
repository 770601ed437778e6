"""An API's request body as it travels: bytes and a content type, decoded by the API's own format.

Each API's spec names its `BodyFormat` (`ApiSpec.body`), so the admission functions never assume JSON: they
hand the raw bytes and the request's `content-type` to the format, the adapter validates what it decoded,
and the format writes the edited body back. An API with another encoding (a multipart form, as
`/v1/audio/transcriptions` takes) is one module with its own format; every JSON API shares `JSON_BODY`,
whose errors and bounds are `fields.load_object`'s.
"""

from __future__ import annotations

import json
from typing import Any, Protocol

from extproc.admission.vocabulary.fields import load_object


class BodyFormat(Protocol):
    """How an API's request body is encoded: decoded for its adapter, written back after edits."""

    def decode(self, raw: bytes, content_type: str | None) -> dict[str, Any]:
        """The body's fields, for the adapter to validate; AdmissionError(400) naming what is wrong.
        `content_type` is the request's `content-type` header (names.py `CONTENT_TYPE_HEADER`), None
        when it has none."""
        ...

    def encode(self, body: dict[str, Any]) -> bytes:
        """`body` (decoded by `decode`, then edited) as the bytes that go upstream."""
        ...


class JsonBody:
    """A JSON object body, whatever the `content-type` says (the engines' JSON APIs read the body as JSON
    without checking it, and so does the gateway)."""

    def decode(self, raw: bytes, content_type: str | None) -> dict[str, Any]:
        """Invalid UTF-8, invalid JSON, NaN, deep nesting and non-objects are 400s (`load_object`)."""
        return load_object(raw)

    def encode(self, body: dict[str, Any]) -> bytes:
        """Compact JSON; UTF-8 stays unescaped unless a lone surrogate forces escaping."""
        try:
            return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
        except UnicodeEncodeError:
            # A lone surrogate (legal as a JSON escape) cannot be written as UTF-8; keep it escaped instead.
            return json.dumps(body, ensure_ascii=True, separators=(",", ":")).encode("ascii")


JSON_BODY: BodyFormat = JsonBody()
"""The format of every API that takes a JSON object (`ApiSpec.body`'s default)."""
