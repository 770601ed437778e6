"""The Lua response reader (extproc/envoyconf/response.lua) and the sidecar agree on every metadata name.

The reader runs inside Envoy and cannot import extproc/admission/vocabulary/names.py, so it writes the names
again: the namespace it reads the admission from, the key of the reading spec in it, the namespace it writes
its findings to and each finding's key, and the reading spec's fields. Read from the Lua source, each must be
the one names.py (or `ReadSpec.to_struct`) defines: a name changed on one side fails here, not in production,
where the access log would quietly bring back nothing.
"""

from __future__ import annotations

import re

from extproc.admission.vocabulary.names import NAMESPACE, READ_SPEC_KEY, RESPONSE_NAMESPACE, ResponseField
from extproc.admission.vocabulary.readspec import ReadSpec
from extproc.envoyconf.lean import lua_source


def code() -> str:
    """The script without its comments (no string literal in it holds `--`)."""
    return re.sub(r"--[^\n]*", "", lua_source())


def constant(source: str, name: str) -> str:
    """The string a top-level `local NAME = "..."` defines."""
    found = re.findall(rf'^local {name} = "([^"]*)"$', source, flags=re.MULTILINE)
    assert len(found) == 1, f"response.lua defines `local {name}` {len(found)} times"
    return str(found[0])


def test_the_namespaces_and_the_spec_key_are_names_pys() -> None:
    source = code()
    assert constant(source, "IN") == NAMESPACE
    assert constant(source, "OUT") == RESPONSE_NAMESPACE
    assert constant(source, "SPEC") == READ_SPEC_KEY
    # Read and written through those constants only: no other literal spells a namespace.
    literals = re.findall(r'"([^"\\]*)"', source)
    assert literals.count(NAMESPACE) == 1 and literals.count(RESPONSE_NAMESPACE) == 1
    assert "dynamicMetadata():get(IN)" in source and "admitted[SPEC]" in source
    assert "dynamicMetadata():set(OUT, key, value)" in source


def test_the_reader_writes_exactly_the_response_fields() -> None:
    source = code()
    written = re.findall(r'(?<!function )\bset\(handle, "([^"]*)"', source)
    assert set(written) == {field.value for field in ResponseField}
    # Every write is a call of `set(handle, key, value)` with a literal key, so the list above is complete.
    assert len(re.findall(r"(?<!function )\bset\(handle,", source)) == len(written)


def test_the_reader_reads_the_fields_the_spec_writes() -> None:
    spec = ReadSpec(content=("c",), usage_only="o")  # every optional field set: all keys written
    read = set(re.findall(r"\bspec\.(\w+)", code()))
    assert read == set(spec.to_struct(strip=True))
