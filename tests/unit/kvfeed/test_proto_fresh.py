"""The committed generated code must match proto/feedback.proto; regenerate with scripts/gen_proto.sh."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
GENERATED = ("feedback_pb2.py", "feedback_pb2.pyi", "feedback_pb2_grpc.py")


@pytest.mark.parametrize("relative", [False, True], ids=["absolute-paths", "relative-paths-as-make-proto"])
def test_generated_code_is_fresh(tmp_path: Path, relative: bool) -> None:
    """`make proto` passes a relative interpreter (.venv/bin/python) and the script changes directory before
    running it; both spellings must regenerate the committed bytes."""
    python, out = sys.executable, str(tmp_path)
    if relative:
        python, out = os.path.relpath(sys.executable, ROOT), os.path.relpath(tmp_path, ROOT)
    result = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gen_proto.sh"), out],
        env={**os.environ, "PYTHON": python},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    stale = [
        name
        for name in GENERATED
        if (tmp_path / name).read_bytes() != (ROOT / "extproc" / "kvfeed" / "proto" / name).read_bytes()
    ]
    assert not stale, f"stale generated code {stale}: run scripts/gen_proto.sh (make proto) and commit"


def test_generated_import_is_package_absolute() -> None:
    from extproc.kvfeed.proto import feedback_pb2, feedback_pb2_grpc

    assert feedback_pb2.DESCRIPTOR.package == "extproc.feedback.v1"
    assert hasattr(feedback_pb2_grpc, "KvFeedServicer")
