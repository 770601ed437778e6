"""Reading Azure-format traces and building synthetic samples."""

from __future__ import annotations

from pathlib import Path

import pytest

from extproc.plan.traffic import TrafficError, load_trace, synthetic_sample

HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens"


def write_trace(path: Path, rows: list[str]) -> Path:
    # The published files use CRLF line ends, seven fractional digits and no trailing newline.
    path.write_bytes("\r\n".join([HEADER, *rows]).encode())
    return path


@pytest.fixture
def trace(tmp_path: Path) -> Path:
    return write_trace(
        tmp_path / "trace.csv",
        [
            "2023-11-16 18:15:46.6805900,374,44",
            "2023-11-16 18:15:47.1805900,396,109",
            "2023-11-16 18:15:48.6805900,879,55",
            "2023-11-16 18:15:50.6805900,91,16",
        ],
    )


def test_load_offsets_lengths_and_stats(trace: Path) -> None:
    sample = load_trace(trace)
    assert [r.arrival_s for r in sample.requests] == pytest.approx([0.0, 0.5, 2.0, 4.0])
    assert [r.prompt_tokens for r in sample.requests] == [374, 396, 879, 91]
    assert sample.mean_prompt == pytest.approx(435.0)
    assert sample.mean_output == pytest.approx(56.0)
    assert sample.rate_rps == pytest.approx(3 / 4.0)
    assert sample.percentile("prompt_tokens", 0.9) == 879


def test_limit_window_and_speedup(trace: Path) -> None:
    assert len(load_trace(trace, limit=2).requests) == 2
    assert len(load_trace(trace, window_s=2.0).requests) == 3
    fast = load_trace(trace, speedup=2.0)
    assert fast.requests[-1].arrival_s == pytest.approx(2.0)
    assert fast.rate_rps == pytest.approx(1.5)


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ("2023-11-16 18:15:47.1,x,3", "trace.csv:3: ContextTokens: expected a whole number"),
        ("2023-11-16 18:15:47.1,3,-1", "trace.csv:3: GeneratedTokens: must be >= 0"),
        ("yesterday,3,4", "trace.csv:3: TIMESTAMP: unreadable"),
        ("2023-11-16 18:15:40.0,3,4", "trace.csv:3: TIMESTAMP: rows must be in arrival order"),
    ],
)
def test_bad_rows_name_file_line_and_column(tmp_path: Path, row: str, message: str) -> None:
    path = write_trace(tmp_path / "trace.csv", ["2023-11-16 18:15:46.6805900,374,44", row])
    with pytest.raises(TrafficError, match=message):
        load_trace(path)


def test_missing_columns_and_files(tmp_path: Path) -> None:
    bad = tmp_path / "bad.csv"
    bad.write_text("time,prompt\n1,2\n")
    with pytest.raises(TrafficError, match="missing column"):
        load_trace(bad)
    with pytest.raises(TrafficError, match="cannot read"):
        load_trace(tmp_path / "none.csv")
    empty = write_trace(tmp_path / "empty.csv", [])
    with pytest.raises(TrafficError, match="no requests"):
        load_trace(empty)


def test_synthetic_sample_is_seeded() -> None:
    a = synthetic_sample(500, 100, 5.0, count=200, seed=3)
    assert a == synthetic_sample(500, 100, 5.0, count=200, seed=3)
    assert a != synthetic_sample(500, 100, 5.0, count=200, seed=4)
    assert {r.prompt_tokens for r in a.requests} == {500}
    assert a.rate_rps == pytest.approx(5.0, rel=0.2)
    with pytest.raises(TrafficError):
        synthetic_sample(0, 100, 5.0, count=10)
