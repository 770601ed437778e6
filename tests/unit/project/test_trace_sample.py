"""The shipped trace sample (bench/traces/) holds every request the protection benchmark replays, so a clone
runs it without the full Azure traces, and each file is a byte-for-byte prefix as its README states."""

from __future__ import annotations

import hashlib
import re

import pytest

from bench.protection import trace as tr

FULL_RUN_REQUESTS = 1200  # bench/protection/main.py run(): 1,200 per trace in the full matrix


@pytest.mark.parametrize("source", sorted(tr.TRACE_FILES))
def test_the_sample_covers_the_benchmarks_window(source: str) -> None:
    window = tr.window(tr.load(tr.SAMPLE_DIR, (source,)), tr.TRACE_START_S, FULL_RUN_REQUESTS)
    assert len(window) == FULL_RUN_REQUESTS


@pytest.mark.parametrize("source", sorted(tr.TRACE_FILES))
def test_the_readme_states_each_files_checksum_and_rows(source: str) -> None:
    name = tr.TRACE_FILES[source]
    data = (tr.SAMPLE_DIR / name).read_bytes()
    readme = (tr.SAMPLE_DIR / "README.md").read_text()
    row = next(line for line in readme.splitlines() if line.startswith(f"| {name} |"))
    assert hashlib.sha256(data).hexdigest() in row
    rows = int(re.sub(r"\D", "", row.split("|")[2]))
    assert data.count(b"\r\n") == rows + 1  # the header row, every row ending in CRLF
