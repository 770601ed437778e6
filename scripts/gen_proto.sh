#!/usr/bin/env bash
# Regenerate the Python code of proto/feedback.proto into extproc/kvfeed/proto/.
#
# The .proto is staged under extproc/kvfeed/proto/ in a scratch include root so protoc emits
# package-absolute imports (`from extproc.kvfeed.proto import feedback_pb2`) and a descriptor path that
# cannot collide with another "feedback.proto" in the process.
#
# Usage: scripts/gen_proto.sh [OUT_DIR]   (default: extproc/kvfeed/proto; the freshness test passes a
# temp dir). Uses the interpreter in $PYTHON, else .venv/bin/python, else python3.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="${1:-$root/extproc/kvfeed/proto}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
python="${PYTHON:-}"
if [[ -z "$python" ]]; then
  if [[ -x "$root/.venv/bin/python" ]]; then python="$root/.venv/bin/python"; else python=python3; fi
fi
# protoc runs from a scratch directory below, so a relative interpreter path (the Makefile passes
# .venv/bin/python) is made absolute first; a bare command name is looked up on PATH now.
if [[ "$python" == */* ]]; then
  python="$(cd "$(dirname "$python")" && pwd)/$(basename "$python")"
else
  python="$(command -v "$python")"
fi

scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT
mkdir -p "$scratch/src/extproc/kvfeed/proto" "$scratch/gen" "$out"
cp "$root/proto/feedback.proto" "$scratch/src/extproc/kvfeed/proto/feedback.proto"

(
  cd "$scratch/src"
  "$python" -m grpc_tools.protoc -I . \
    --python_out="$scratch/gen" --pyi_out="$scratch/gen" --grpc_python_out="$scratch/gen" \
    extproc/kvfeed/proto/feedback.proto
)

for f in feedback_pb2.py feedback_pb2.pyi feedback_pb2_grpc.py; do
  cp "$scratch/gen/extproc/kvfeed/proto/$f" "$out/$f"
done
if [[ ! -f "$out/__init__.py" ]]; then
  printf '"""Generated gRPC/protobuf code of proto/feedback.proto; regenerate with scripts/gen_proto.sh."""\n' \
    >"$out/__init__.py"
fi
