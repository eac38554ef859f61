#!/usr/bin/env bash
# Wheels the GPU machine lacks (it has no network; its image has Python 3.12, torch, triton, numpy,
# msgpack, pytest, httpx, scipy, transformers, but not these), fetched here into .whl/ (ignored by git)
# for scripts/gpu_check.sh to install with pip --no-index. Carry `.whl` with the repository.
#   scripts/gpu_wheels.sh            # into .whl/
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
mkdir -p .whl
PKGS=(gguf fastapi starlette pydantic pydantic-core annotated-types typing-inspection uvicorn websockets
      prometheus-client)
for pkg in "${PKGS[@]}"; do
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform any -d .whl "$pkg"
done
ls -la .whl
du -sh .whl
