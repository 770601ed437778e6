"""A client's deadline for its first token, read from the request's headers.

Two headers carry one, both in milliseconds from when the request arrives (for the sidecar: when it first
sees the request, its headers in the inline profile, its body in the lean one):

- `x-extproc-ttft-deadline-ms`, this gateway's own. A client that names it means it: a value that is not a
  whole number of milliseconds from 0 to `MAX_DEADLINE_MS` is refused with a 400 naming the header, before
  anything is held, rather than ignored into a wait the client said it would not accept.
- `x-llm-d-slo-ttft-ms`, llm-d's, which its flow control orders requests by (the deadline is the arrival
  time plus the header's milliseconds). Read as llm-d reads it: the trimmed value parsed as a base-10
  integer, and a missing, empty, unparsable or negative value ignored, not refused (llm-d/llm-d-router
  pkg/epp/framework/plugins/flowcontrol/ordering/slodeadline/slo_deadline.go `calculateSLODeadline`
  @ ebab687), so a request that an llm-d stack accepts is accepted here too.

Where both are valid the nearer deadline holds. A deadline never makes a request wait longer than its
class would, and never moves it ahead of another tenant (extproc/core/queue/waitqueue.py): it can only
cost its own request a wait, so it needs no trust.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from extproc.admission.vocabulary.errors import AdmissionError
from extproc.admission.vocabulary.names import DEADLINE_HEADER, LLMD_DEADLINE_HEADER

MAX_DEADLINE_MS = 86_400_000
"""A day: past it a value is no first-token deadline but a mistake (a timestamp, a unit in microseconds),
and the longest queue wait any class may have (3,600 s) is far shorter anyway."""

_OWN = re.compile(r"[0-9]{1,9}")
_LLMD = re.compile(r"\+?[0-9]{1,19}")  # Go's strconv.ParseInt, base 10, non-negative (a sign is allowed)


def deadline_ms(headers: Mapping[str, str]) -> int | None:
    """The tightest valid deadline the headers carry, in milliseconds from arrival; None without one.

    Raises AdmissionError(400) naming `x-extproc-ttft-deadline-ms` when that header's value is invalid.
    """
    found = [value for value in (_own(headers), _llmd(headers)) if value is not None]
    return min(found) if found else None


def _own(headers: Mapping[str, str]) -> int | None:
    raw = headers.get(DEADLINE_HEADER)
    if raw is None:
        return None
    value = raw.strip()
    if not _OWN.fullmatch(value) or int(value) > MAX_DEADLINE_MS:
        shown = value if len(value) <= 32 else value[:32] + "..."
        raise AdmissionError(
            400,
            f"'{DEADLINE_HEADER}' must be a whole number of milliseconds from 0 to {MAX_DEADLINE_MS} (the "
            f"time this request's first token is needed by), got {shown!r}.",
            code="invalid_value",
            param=DEADLINE_HEADER,
        )
    return int(value)


def _llmd(headers: Mapping[str, str]) -> int | None:
    value = headers.get(LLMD_DEADLINE_HEADER, "").strip()
    if not _LLMD.fullmatch(value):
        return None
    ms = int(value)
    # llm-d treats a value whose nanoseconds overflow int64 as invalid (the same bound here); anything past
    # a day bounds no wait, so it is kept at a day rather than carried as a huge number.
    return None if ms > (2**63 - 1) // 1_000_000 else min(ms, MAX_DEADLINE_MS)
