"""The Azure LLM inference traces 2023 (CC-BY 4.0; Patel et al., "Splitwise", ISCA 2024).

Only arrival time, ContextTokens and GeneratedTokens are published, so prompts are synthesized
(`prompt_text`): a prompt of N tokens is three single-token words that name the request, then copies of the
single-token word " the". cl100k's pre-tokenizer splits before every "space + letters" run, so BPE never
merges two of them: the sidecar and the simulator both count exactly N. The trace carries no text, so no two
of its prompts share a prefix: the words in front keep the engine's prefix cache (and the sidecar's prefix
booking) from sharing what the trace does not say is shared.
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


HEAD_WORDS = (
    " alpha", " beta", " gamma", " delta", " river", " stone", " cloud", " maple", " orbit", " falcon",
    " ember", " prism", " cedar", " harbor", " lantern", " meadow", " silver", " thunder", " willow",
    " copper",
)  # fmt: skip
"""Single-token cl100k words (with their space); three of them name one of 8,000 requests."""


def prompt_text(tokens: int, index: int) -> str:
    """`tokens` tokens of text no other request of the replay starts with."""
    n = len(HEAD_WORDS)
    head = [HEAD_WORDS[index % n], HEAD_WORDS[index // n % n], HEAD_WORDS[index // n // n % n]]
    return "".join(head[: max(0, tokens)]) + " the" * max(0, tokens - len(head))


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
