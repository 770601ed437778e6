"""Small rules shared by the adapters of the non-OpenAI APIs.

Sources are cited as "vLLM v0.33.0 path:line" (paths under `vllm/`) and "SGLang v0.5.23 path:line"
(paths under `python/sglang/`), read from the release artifacts on PyPI.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from extproc.admission.vocabulary import fields as f
from extproc.admission.vocabulary.parsed import BodyEdits
from extproc.admission.vocabulary.prompt import Prompt

UNNAMED_MODEL = "*"
"""The model a request is metered under when its API lets it name none (SGLang's native API has no `model`
field; vLLM's token-in/token-out, pooling and tokenizer APIs make it optional): the configuration's
default model entry (`models."*"`, `extproc.config.DEFAULT_MODEL`), so it shares that pool's limits."""


def optional_model(body: Mapping[str, Any]) -> str:
    """`model` when the API makes it optional: validated when present, else `UNNAMED_MODEL`."""
    if body.get("model") is None:
        return UNNAMED_MODEL
    return f.model_name(body)


def bool_field(body: Mapping[str, Any], key: str, param: str | None = None) -> bool:
    return bool(f.opt_bool(body, key, param or key))


PADDING_VALUES = ("max_length", "do_not_pad")


def padded(body: Mapping[str, Any], found: Iterable[Prompt]) -> tuple[Prompt, ...]:
    """vLLM pooling `padding: "max_length"` pads every prompt to the maximum input length, the whole context
    window (vLLM v0.33.0 entrypoints/pooling/base/protocol.py:43-53, renderers/params.py:322): each
    prompt is then charged the window, whatever its text."""
    value = body.get("padding")
    if value is not None and value not in PADDING_VALUES:
        f.bad(
            f"'padding' must be one of {', '.join(PADDING_VALUES)}, got {value!r}.",
            code="invalid_value",
            param="padding",
        )
    prompts = tuple(found)
    if value == "max_length":
        return tuple(Prompt(opaque=True) for _ in prompts)
    return prompts


def drop_priority(body: dict[str, Any], edits: BodyEdits) -> bool:
    """For APIs without a `priority` field: a client's stray `priority` is removed; none can be set."""
    if (edits.strip_priority or edits.priority is not None) and "priority" in body:
        del body["priority"]
        return True
    return False
