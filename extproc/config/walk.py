"""Walks over the schema: the keys a file may set (the docs test), and how the file's `null`s are read."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, get_args, get_origin

from extproc.config.fields import unwrapped
from extproc.config.schema import ConfigFile, Section


def leaf_keys(section: type[Section] = ConfigFile, prefix: str = "") -> Iterator[str]:
    """Every key a file may set, as a dotted path: a map's keys as `NAME`, a list's items as `[0]`
    (`limits.models.NAME.max_concurrency`, `classes[0].queue.max_wait_seconds`)."""
    for name, info in section.model_fields.items():
        key = f"{prefix}{info.alias or name}"
        kind = unwrapped(info.annotation)
        if get_origin(kind) is dict:
            kind, key = unwrapped(get_args(kind)[1]), f"{key}.NAME"
        elif get_origin(kind) in (tuple, list):
            kind, key = unwrapped(get_args(kind)[0]), f"{key}[0]"
        if isinstance(kind, type) and issubclass(kind, Section):
            yield from leaf_keys(kind, f"{key}.")
        else:
            yield key


def nulls_absent(data: Any, kind: Any = None) -> Any:
    """Parsed YAML as the schema reads it: a section's key set to `null` is absent (its default applies), a
    map entry set to `null` is an empty section (`tenants: {acme: }` names acme with no settings). A
    `null` under a key the section does not know is kept, so it is still reported as unknown.

    One walk before validation, which skips every mapping without a `null` or a nested key (a tenant's
    limits), so a 10^5-tenant file costs little; a validator per section would cost a Python call each.
    """
    kind = ConfigFile if kind is None else kind
    if isinstance(kind, type) and issubclass(kind, Section):
        if not isinstance(data, Mapping):
            return data
        nested, keys = kind.nested(), kind.yaml_keys()
        if nested.keys().isdisjoint(data) and None not in data.values():
            return data
        return {
            k: nulls_absent(v, nested[k]) if k in nested else v
            for k, v in data.items()
            if v is not None or k not in keys
        }
    origin = get_origin(kind)
    if origin is dict and isinstance(data, Mapping):
        value = unwrapped(get_args(kind)[1])
        if not (isinstance(value, type) and issubclass(value, Section)):
            return {k: nulls_absent(v, value) for k, v in data.items()}
        nested = value.nested()
        return {  # the common entry (a tenant's limits) checked here, without a call per entry
            k: v
            if isinstance(v, Mapping) and nested.keys().isdisjoint(v) and None not in v.values()
            else _entry(v, value)
            for k, v in data.items()
        }
    if origin in (tuple, list) and isinstance(data, list):
        item = unwrapped(get_args(kind)[0])
        return [_entry(v, item) for v in data]
    return data


def _entry(value: Any, kind: Any) -> Any:
    """A map entry or list item: `null` where a section belongs is an empty one."""
    if value is None and isinstance(kind, type) and issubclass(kind, Section):
        return {}
    return nulls_absent(value, kind)
