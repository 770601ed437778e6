"""The JSON log lines (extproc/logs.py): one object per record, extras as keys, a cached timestamp text that
still changes with every second and shows each record's own milliseconds."""

from __future__ import annotations

import json
import logging
import sys

from extproc.logs import JsonFormatter


def record(created: float, **extra: object) -> logging.LogRecord:
    rec = logging.LogRecord("extproc.x", logging.INFO, __file__, 1, "request %s", ("refused",), None)
    rec.created = created
    rec.msecs = round(created % 1 * 1000) % 1000  # as LogRecord derives it, without float truncation
    for key, value in extra.items():
        setattr(rec, key, value)
    return rec


def test_a_line_carries_the_message_its_extras_and_the_time_to_the_millisecond() -> None:
    line = json.loads(JsonFormatter().format(record(1_700_000_000.25, status=429, reason="tpm")))
    assert line == {
        "ts": "2023-11-14T22:13:20.250Z",
        "level": "info",
        "logger": "extproc.x",
        "msg": "request refused",
        "status": 429,
        "reason": "tpm",
    }


def test_the_cached_second_moves_on_and_milliseconds_are_each_records_own() -> None:
    formatter = JsonFormatter()
    stamps = [json.loads(formatter.format(record(t)))["ts"] for t in (10.001, 10.999, 11.0, 10.5)]
    assert stamps == [
        "1970-01-01T00:00:10.001Z",
        "1970-01-01T00:00:10.999Z",
        "1970-01-01T00:00:11.000Z",
        "1970-01-01T00:00:10.500Z",
    ]


def test_an_exception_is_logged_with_its_traceback() -> None:
    try:
        raise ValueError("boom")
    except ValueError:
        rec = record(1.0)
        rec.exc_info = sys.exc_info()
    line = json.loads(JsonFormatter().format(rec))
    assert "ValueError: boom" in line["exc"]
