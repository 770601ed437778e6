"""Traffic samples for planning: an Azure LLM inference trace, or mean lengths and a rate.

The Azure 2023 traces (`../shared/traces/`, README there) have one row per request:
`TIMESTAMP,ContextTokens,GeneratedTokens`, timestamps `YYYY-MM-DD HH:MM:SS.fffffff` (seven fractional
digits, CRLF line ends). The planner uses the sample twice: its mean lengths and rate size the limits, and
`--rehearse` replays it request by request against the simulated deployment.
"""

from __future__ import annotations

import csv
import random
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

TRACE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


class TrafficError(ValueError):
    """A traffic sample that cannot be used; the message names the file, row and column."""


@dataclass(frozen=True)
class TraceRequest:
    """One request: seconds after the first arrival, prompt and generated token counts."""

    arrival_s: float
    prompt_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class TrafficSample:
    """Requests in arrival order and where they came from."""

    source: str
    requests: tuple[TraceRequest, ...]

    @property
    def span_s(self) -> float:
        return self.requests[-1].arrival_s - self.requests[0].arrival_s if self.requests else 0.0

    @property
    def mean_prompt(self) -> float:
        return sum(r.prompt_tokens for r in self.requests) / len(self.requests)

    @property
    def mean_output(self) -> float:
        return sum(r.output_tokens for r in self.requests) / len(self.requests)

    @property
    def rate_rps(self) -> float | None:
        """Mean arrival rate; None for a single request (no interval to measure)."""
        if len(self.requests) < 2 or self.span_s <= 0:
            return None
        return (len(self.requests) - 1) / self.span_s

    def percentile(self, field: str, q: float) -> int:
        values = sorted(int(getattr(r, field)) for r in self.requests)
        return values[min(len(values) - 1, int(q * len(values)))]


def _timestamp(text: str) -> datetime:
    """Parse `YYYY-MM-DD HH:MM:SS.fffffff`; Python's %f takes at most six fractional digits."""
    stamp, dot, fraction = text.strip().partition(".")
    value = f"{stamp}.{fraction[:6]}" if dot else stamp
    return datetime.strptime(value, "%Y-%m-%d %H:%M:%S.%f" if dot else "%Y-%m-%d %H:%M:%S")


def _count(row: dict[str, str], column: str, where: str) -> int:
    text = row.get(column)
    try:
        value = int(text or "")
    except ValueError:
        raise TrafficError(f"{where}: {column}: expected a whole number, got {text!r}") from None
    if value < 0:
        raise TrafficError(f"{where}: {column}: must be >= 0, got {value}")
    return value


def load_trace(
    path: str | Path, limit: int | None = None, window_s: float | None = None, speedup: float = 1.0
) -> TrafficSample:
    """Read an Azure-format trace: the first `limit` requests and/or the first `window_s` seconds,
    arrivals compressed by `speedup` (2 = twice the rate, same lengths)."""
    if speedup <= 0:
        raise TrafficError("--traffic-speedup: must be positive")
    file = Path(path)
    try:
        handle = file.open(newline="", encoding="utf-8")
    except OSError as exc:
        raise TrafficError(f"{file}: cannot read: {exc.strerror}") from exc
    requests: list[TraceRequest] = []
    with handle:
        reader = csv.DictReader(handle)
        missing = [c for c in TRACE_COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise TrafficError(f"{file}: missing column(s) {', '.join(missing)} (expected {TRACE_COLUMNS})")
        first: datetime | None = None
        for line, row in enumerate(reader, start=2):
            where = f"{file}:{line}"
            try:
                stamp = _timestamp(row["TIMESTAMP"])
            except ValueError:
                raise TrafficError(f"{where}: TIMESTAMP: unreadable {row['TIMESTAMP']!r}") from None
            first = first or stamp
            offset = (stamp - first).total_seconds()
            if offset < 0:
                raise TrafficError(f"{where}: TIMESTAMP: rows must be in arrival order")
            if window_s is not None and offset > window_s:
                break
            prompt = _count(row, "ContextTokens", where)
            output = _count(row, "GeneratedTokens", where)
            requests.append(TraceRequest(offset / speedup, prompt, output))
            if limit is not None and len(requests) >= limit:
                break
    if not requests:
        raise TrafficError(f"{file}: no requests in the selected part of the trace")
    return TrafficSample(source=str(file), requests=tuple(requests))


def synthetic_sample(
    mean_prompt: float, mean_output: float, rate_rps: float, count: int, seed: int = 0
) -> TrafficSample:
    """Poisson arrivals at `rate_rps` with every request at the mean lengths (seeded, so repeatable)."""
    if mean_prompt < 1 or mean_output < 1 or rate_rps <= 0 or count < 1:
        raise TrafficError("--prompt-tokens-mean and --output-tokens-mean must be >= 1, --request-rate > 0")
    rng = random.Random(seed)
    now = 0.0
    requests = []
    for _ in range(count):
        requests.append(TraceRequest(now, round(mean_prompt), round(mean_output)))
        now += rng.expovariate(rate_rps)
    return TrafficSample(source=f"synthetic ({rate_rps:g} req/s, seed {seed})", requests=tuple(requests))


def sample_from(requests: Sequence[TraceRequest], source: str = "inline") -> TrafficSample:
    return TrafficSample(source=source, requests=tuple(requests))
