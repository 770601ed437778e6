"""The engine /metrics pages under tests/data/metrics, read by name: the parser's, the pace meter's and the
fixture-coverage suites read the same files."""

from __future__ import annotations

from pathlib import Path

DATA = Path(__file__).resolve().parents[1] / "data" / "metrics"


def page(name: str) -> str:
    """The text of one stored page (`vllm_0.33.0_dp2.txt`)."""
    return (DATA / name).read_text()
