"""`ConfigError` and the bounds on what one error may quote: a log line must stay a line."""

from __future__ import annotations

import reprlib
from typing import Any

MAX_PROBLEM_CHARS = 300
"""The most one problem's text may carry: an error quotes the bad value, and a log line must stay a line."""
MAX_PROBLEMS_SHOWN = 20
"""Problems joined into the message (and so the log line); `ConfigError.problems` keeps every one."""
MAX_SUGGESTIONS = 100
"""Unknown keys that get a "did you mean" (difflib) suggestion; the rest are listed plainly."""


def capped(text: str, limit: int = MAX_PROBLEM_CHARS) -> str:
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters in all)"


_SHOWN = reprlib.Repr()
_SHOWN.maxstring = _SHOWN.maxother = 80
_SHOWN.maxlist = _SHOWN.maxdict = 5
_SHOWN.maxlevel = 2


def shown(value: Any) -> str:
    """A bad value as an error quotes it: bounded however large or deeply aliased the value is."""
    return _SHOWN.repr(value)


class ConfigError(ValueError):
    """A configuration that cannot be used; each problem starts with the offending key path.

    One error may carry several problems (every unknown key of a file, say), each capped to
    `MAX_PROBLEM_CHARS`; the message joins the first `MAX_PROBLEMS_SHOWN`, so a log line stays bounded.
    """

    def __init__(self, *problems: str) -> None:
        self.problems: tuple[str, ...] = tuple(capped(p) for p in problems) or ("<root>: invalid config",)
        text = "; ".join(self.problems[:MAX_PROBLEMS_SHOWN])
        more = len(self.problems) - MAX_PROBLEMS_SHOWN
        super().__init__(text if more <= 0 else f"{text}; and {more} more")
