"""Pydantic's validation errors as the operator reads them: `key.path: sentence`, unknown keys first, each
with the closest key its section knows."""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from typing import Any, get_args, get_origin

from pydantic import BaseModel
from pydantic_core import ErrorDetails

from extproc.config import schema
from extproc.config.errors import MAX_SUGGESTIONS, shown
from extproc.config.fields import unwrapped


def problems(errors: Sequence[ErrorDetails]) -> list[str]:
    """Pydantic's errors as `key.path: sentence`, unknown keys first."""
    unknown = [e for e in errors if e["type"] == "extra_forbidden"]
    rest = [e for e in errors if e["type"] != "extra_forbidden"]
    out = [_unknown(e["loc"], i < MAX_SUGGESTIONS) for i, e in enumerate(unknown)]
    return out + [f"{key_path(_owner(e['loc']))}: {_sentence(e)}" for e in rest]


def key_path(loc: Sequence[int | str]) -> str:
    """`("classes", 0, "name")` -> `classes[0].name`; the empty path is `<root>`."""
    text = ""
    for part in loc:
        if isinstance(part, int):
            text += f"[{part}]"
        else:
            text += f".{part}" if text else str(part)
    return text or "<root>"


def _owner(loc: Sequence[int | str]) -> Sequence[int | str]:
    """A map key's own error (`models.3.[key]`) is the map's."""
    return loc[:-2] if loc and loc[-1] == "[key]" else loc


def _sentence(error: ErrorDetails) -> str:
    kind = error["type"]
    if kind == "config":
        return error["msg"]
    if kind == "missing":
        return "required"
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        return f"must be a mapping, got {type(error.get('input')).__name__}"
    if kind in ("tuple_type", "list_type"):
        return f"must be a list, got {type(error.get('input')).__name__}"
    return error["msg"]


def _unknown(loc: Sequence[int | str], suggest: bool) -> str:
    name = loc[-1] if loc else ""
    shown_name = name if isinstance(name, str) else shown(name)
    known = sorted(_section_at(loc[:-1]).yaml_keys()) if suggest else []
    close = difflib.get_close_matches(shown_name, known, n=1) if known else []
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"{key_path([*loc[:-1], shown_name])}: unknown key{hint}"


def _section_at(loc: Sequence[int | str]) -> type[schema.Section]:
    """The schema class of the mapping at `loc` (the keys an unknown key is compared with)."""
    kind: Any = schema.ConfigFile
    for part in loc:
        kind = unwrapped(kind)
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            fields = {info.alias or name: info.annotation for name, info in kind.model_fields.items()}
            kind = fields.get(str(part))
        elif get_origin(kind) in (dict, tuple, list):
            kind = get_args(kind)[-1 if get_origin(kind) is dict else 0]
    kind = unwrapped(kind)
    return kind if isinstance(kind, type) and issubclass(kind, schema.Section) else schema.Section
