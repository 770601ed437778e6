"""Deny by default: every request path is metered, free, or refused at the gateway.

The backend behind the gateway serves far more than the three OpenAI generation APIs: other generation
APIs, pooling models, tokenizers, admin endpoints, its own metrics. A path nobody listed must never reach
it, so routing is a table: `METERED` paths are admitted against the limiter through their API's adapter,
`FREE` paths pass untouched (listing models, health, version), and anything else, including a known path
with another method, is refused with an OpenAI-style 404 before it leaves the gateway.

The path is normalized the way servers do before matching, so no spelling the backend's router would
still serve can slip past: query string and fragment dropped, percent-escapes decoded (repeatedly, so
`%252F` cannot hide a slash either), backslashes read as slashes, `.`/`..` segments resolved, repeated and
trailing slashes removed. Methods compare case-insensitively.
"""

from __future__ import annotations

import enum
import posixpath
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from urllib.parse import unquote

from extproc.admission.request import Api


class RouteKind(enum.StrEnum):
    METERED = "metered"
    FREE = "free"
    DENIED = "denied"


@dataclass(frozen=True, slots=True)
class PathRule:
    """One row of the table: which path, which methods, and what happens to it (with the reason why)."""

    path: str
    methods: frozenset[str]
    kind: RouteKind
    api: Api | None = None
    reason: str = ""


def _metered(path: str, api: Api, reason: str) -> PathRule:
    return PathRule(path, frozenset({"POST"}), RouteKind.METERED, api, reason)


def _free(path: str, reason: str, methods: Iterable[str] = ("GET",)) -> PathRule:
    return PathRule(path, frozenset(methods), RouteKind.FREE, None, reason)


DEFAULT_RULES: tuple[PathRule, ...] = (
    _metered("/v1/chat/completions", Api.CHAT, "generates"),
    _metered("/v1/completions", Api.COMPLETIONS, "generates"),
    _metered("/v1/embeddings", Api.EMBEDDINGS, "runs the model on the prompt"),
    _free("/v1/models", "lists served models; runs nothing"),
    _free("/health", "liveness; runs nothing"),
    _free("/ping", "liveness (SageMaker); runs nothing", ("GET", "POST")),
    _free("/version", "server version; runs nothing"),
)
"""The built-in table; docs/admission.md lists every vLLM and SGLang path with its kind and reason."""


def normalize_path(path: str) -> str:
    """The path as a server's router would see it (see the module docstring)."""
    for sep in ("?", "#"):
        cut = path.find(sep)
        if cut >= 0:
            path = path[:cut]
    for _ in range(4):
        decoded = unquote(path)
        if decoded == path:
            break
        path = decoded
    path = posixpath.normpath("/" + path.replace("\\", "/"))
    return re.sub(r"/+", "/", path).rstrip("/") or "/"


@dataclass(frozen=True)
class PathTable:
    """Rules by normalized path; built once per config."""

    rules: Mapping[str, PathRule]

    @classmethod
    def build(cls, rules: Iterable[PathRule] = DEFAULT_RULES) -> PathTable:
        return cls({rule.path: rule for rule in rules})

    def route(self, method: str, path: str) -> PathRule | None:
        """The rule this request falls under, or None: refused (unknown path, or a method not listed).

        OPTIONS (a browser's CORS preflight) is free on every listed path: it runs no model.
        """
        rule = self.rules.get(normalize_path(path))
        if rule is None:
            return None
        verb = method.upper()
        if verb in rule.methods:
            return rule
        if verb == "OPTIONS":
            return _free(rule.path, "CORS preflight", ("OPTIONS",))
        return None


DEFAULT_TABLE = PathTable.build()
