#!/usr/bin/env bash
# The one prepared GPU check: scripts/gpu_check.sh OUTDIR [bench.gpu_check options]
#
# From a bare machine with the repository (no network): installs the wheels of a .whl/ folder in the
# repository if there is one (pip --no-index), runs the CUDA tests, the tree-attention
# microbenchmark, the 1.5B-shaped verify forward benchmark, bench.serve (ar against auto, where
# the SmolLM2 model files are in the model store), the fleet with one GPU replica (bench.fleet's
# proxy overhead and resumes, where Ray Serve is installed) and, with 2+ GPUs visible, the
# tensor-parallel (NCCL) tests within one time budget (default 450 s), and writes
# OUTDIR/gpu_check.json (+ tree_attention.json, gpu_forward.json, pytest.xml, pytest_tp.xml)
# and OUTDIR/gpu_check.log. A failing stage is recorded in the JSON and the next one runs.
# Exit code: 0 when the report was written (read its "status": ok, partial, no-gpu, dry-run),
# 2 for bad arguments. Without a GPU it writes a report saying "no-gpu". --dry-run: the plan only.
# PYTHON=... chooses the interpreter (default: the repository's .venv if present, else python3).
set -u
if [ $# -lt 1 ] || [ "${1#-}" != "$1" ]; then
    echo "usage: scripts/gpu_check.sh OUTDIR [--budget-s S] [--stages a,b] [--quick] [--slow] [--dry-run]" >&2
    exit 2
fi
cd "$(dirname "$0")/.." || exit 2
if [ -z "${PYTHON:-}" ]; then
    if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"
exec "$PYTHON" -m bench.gpu_check "$@" --python "$PYTHON"
