"""Structured logging: one JSON object per line, with the `extra` fields of each call as keys.

Request bodies are never logged; handlers pass only sizes, counts, model names and decisions.

A refusal is logged at info level, and under overload refusals are most requests: a line must be cheap.
The formatter reuses the timestamp's text within a second, and `setup_logging` turns off what the standard
library gathers for every record but these lines never show (the caller's file and line, found by walking the
stack; thread, process and multiprocessing names). bench/RESULTS.md section 2d has the figures.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import sys
import time
from collections.abc import Callable, Hashable
from typing import Any

_RESERVED = frozenset(vars(logging.makeLogRecord({})).keys()) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__()
        self._second = -1
        self._stamp = ""

    def _timestamp(self, record: logging.LogRecord) -> str:
        second = int(record.created)
        if second != self._second:  # one strftime per second, not per line
            self._stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
            self._second = second
        return f"{self._stamp}.{int(record.msecs):03d}Z"

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": self._timestamp(record),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _RESERVED and key[0] != "_":
                out[key] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str, ensure_ascii=False)


def setup_logging(level: str = "INFO") -> None:
    """Root logger to stderr as JSON lines; called by entry points (sidecar, exporter), never libraries.

    It also switches off, for the whole process, the record fields no line shows: `findCaller`'s stack walk
    (`logging._srcfile`), and the thread, process and multiprocessing names. And it makes a fatal signal in a
    C extension (a SIGSEGV in gRPC's, as the exporter once died) write every thread's Python stack to
    stderr before the process dies (`faulthandler`), so the log says where, not only the exit code.
    """
    faulthandler.enable()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    logging._srcfile = None  # the documented switch (logging docs, "Optimization")
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False


class RateLimitedLog:
    """Allows one log per key per `interval` seconds; `allow` also reports how many were suppressed.

    A target that is down fails every second; logging each failure would flood the node's log pipeline, so
    state changes are always logged and repeats at most once per window."""

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
