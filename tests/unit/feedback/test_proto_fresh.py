"""The committed generated code must match proto/feedback.proto; regenerate with scripts/gen_proto.sh."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
GENERATED = ("feedback_pb2.py", "feedback_pb2.pyi", "feedback_pb2_grpc.py")


def test_generated_code_is_fresh(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools")
    env = {**os.environ, "PYTHON": sys.executable}
    subprocess.run(
        ["bash", str(ROOT / "scripts" / "gen_proto.sh"), str(tmp_path)],
        check=True,
        env=env,
        capture_output=True,
        timeout=60,
    )
    stale = [
        name
        for name in GENERATED
        if (tmp_path / name).read_bytes() != (ROOT / "extproc" / "feed" / "proto" / name).read_bytes()
    ]
    assert not stale, f"stale generated code {stale}: run scripts/gen_proto.sh (make proto) and commit"


def test_generated_import_is_package_absolute() -> None:
    from extproc.feed.proto import feedback_pb2, feedback_pb2_grpc

    assert feedback_pb2.DESCRIPTOR.package == "extproc.feedback.v1"
    assert hasattr(feedback_pb2_grpc, "KvFeedServicer")
