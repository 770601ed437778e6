"""The real-engine Mooncake replay (bench/protection/mooncake_engine.py) makes prompts that share what the
trace's block ids share, and no more: equal leading ids give equal leading words, one token each, so the
engine's prefix cache and the sidecar's credit see the trace's sharing."""

from __future__ import annotations

import json
from pathlib import Path

from bench.protection.mooncake_engine import ID_TOKENS, MAX_OUTPUT, load
from tests.support.engine import MAX_MODEL_LEN


def write(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_prompts_share_their_leading_ids_words_and_keep_the_traces_times(tmp_path: Path) -> None:
    trace = write(
        tmp_path / "trace.jsonl",
        [
            {"timestamp": 1_000, "input_length": 1_024, "output_length": 10, "hash_ids": [1, 2]},
            {"timestamp": 600_000, "input_length": 1_500, "output_length": 5_000, "hash_ids": [1, 2, 3]},
            {"timestamp": 601_500, "input_length": 1_024, "output_length": 20, "hash_ids": [1, 4]},
            {"timestamp": 602_000, "input_length": 153_600, "output_length": 1, "hash_ids": list(range(300))},
            {"timestamp": 603_000, "input_length": 100, "output_length": 3, "hash_ids": [9]},
        ],
    )
    first, second, third = load(trace, 600.0, 3)
    assert (first.at, second.at, third.at) == (0.0, 1.5, 3.0)  # the long prompt past the window is left out
    a, b = first.text.split(), second.text.split()
    assert len(a) == 94 and len(b) == 2 * ID_TOKENS  # 1,500 x 32 / 512, rounded up; the last id cut
    assert a[:ID_TOKENS] == b[:ID_TOKENS] and a[ID_TOKENS : 2 * ID_TOKENS] != b[ID_TOKENS:]
    assert len(third.text.split()) == 7  # 100 tokens scaled: a partial block
    assert first.output == MAX_OUTPUT and second.output == 20
    assert all(len(r.text.split()) + r.output < MAX_MODEL_LEN for r in (first, second, third))
