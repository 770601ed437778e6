"""The Azure LLM inference traces 2023 (CC-BY 4.0; Patel et al., "Splitwise", ISCA 2024).

Only arrival time, ContextTokens and GeneratedTokens are published, so prompts are synthesized: a prompt of
N tokens is N copies of the single-token word " the". cl100k's pre-tokenizer splits before every
"space + letters" run, so BPE never merges two of them: the sidecar and the simulator both count exactly N
(the simulator's docs state the same property for its vocabulary).
"""

from __future__ import annotations

import csv
import os
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from bench.common import REPO

TRACE_FILES = {"conv": "AzureLLMInferenceTrace_conv.csv", "code": "AzureLLMInferenceTrace_code.csv"}
ENV_VAR = "EXTPROC_TRACES_DIR"
SAMPLE_DIR = REPO / "bench" / "traces"
TRACE_START_S = 600.0
"""Where every run's slice of a trace starts: past its first ten minutes (the ramp-up), the same for each."""


def traces_dir() -> Path | None:
    """Where the CSVs are: $EXTPROC_TRACES_DIR, else `../shared/traces` next to the repository (CI copy), else
    the sample the repository ships (bench/traces/: the first rows of each trace, every request the benchmark
    replays; its README says where the full traces live)."""
    candidates = []
    if os.environ.get(ENV_VAR):
        candidates.append(Path(os.environ[ENV_VAR]))
    candidates += [REPO.parent / "shared" / "traces", Path("/work/shared/traces"), SAMPLE_DIR]
    for cand in candidates:
        if all((cand / name).is_file() for name in TRACE_FILES.values()):
            return cand
    return None


@dataclass(frozen=True)
class TraceRequest:
    t: float  # seconds since the slice start, at the trace's own rate
    context: int
    generated: int
    source: str  # "conv" or "code"


def _parse_ts(text: str) -> float:
    # 7 fractional digits; datetime's %f takes at most 6.
    return datetime.strptime(text[:26], "%Y-%m-%d %H:%M:%S.%f").timestamp()


def load(directory: Path, sources: tuple[str, ...] = ("conv",)) -> list[TraceRequest]:
    """The named traces merged by arrival time (one replica serving all of them)."""
    rows: list[tuple[float, int, int, str]] = []
    for source in sources:
        name = TRACE_FILES[source]
        with open(directory / name, newline="") as f:
            for rec in csv.DictReader(f):
                t = _parse_ts(rec["TIMESTAMP"])
                rows.append((t, int(rec["ContextTokens"]), int(rec["GeneratedTokens"]), source))
    rows.sort()
    t0 = rows[0][0]
    return [TraceRequest(t - t0, c, g, s) for t, c, g, s in rows]


def window(requests: list[TraceRequest], start_s: float, count: int) -> list[TraceRequest]:
    """`count` consecutive requests from `start_s` on, re-based so the first arrives at t = 0."""
    chosen = [r for r in requests if r.t >= start_s][:count]
    if not chosen:
        return []
    t0 = chosen[0].t
    return [TraceRequest(r.t - t0, r.context, r.generated, r.source) for r in chosen]
