"""Structured (JSON lines) logging and a rate limiter for repetitive failure logs.

A target that is down fails every second; logging each failure would flood the node's log pipeline, so
state changes (up -> down, down -> up, new reason) are always logged and repeats at most once per window.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Hashable
from typing import Any

_RESERVED = frozenset(vars(logging.makeLogRecord({})).keys()) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg and every `extra=` field."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _RESERVED and not key.startswith("_"):
                out[key] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def configure_json_logging(level: str = "INFO") -> None:
    """Root logger to stderr as JSON lines (for the exporter's entry point; libraries never call it)."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


class RateLimitedLog:
    """Allows one log per key per `interval` seconds; `allow` also reports how many were suppressed."""

    def __init__(self, interval: float = 30.0, clock: Callable[[], float] = time.monotonic) -> None:
        self._interval = interval
        self._clock = clock
        self._last: dict[Hashable, float] = {}
        self._suppressed: dict[Hashable, int] = {}

    def allow(self, key: Hashable) -> tuple[bool, int]:
        now = self._clock()
        last = self._last.get(key)
        if last is not None and now - last < self._interval:
            self._suppressed[key] = self._suppressed.get(key, 0) + 1
            return False, 0
        self._last[key] = now
        return True, self._suppressed.pop(key, 0)

    def forget(self, key: Hashable) -> None:
        self._last.pop(key, None)
        self._suppressed.pop(key, None)
