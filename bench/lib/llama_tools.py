"""llama.cpp's own programs, built from the llama.cpp source that the installed llama-cpp-python vendors.

`bench.end_to_end.peers` compares against llama.cpp's plain decoding (`llama-completion`) and its draft-model
speculative decoding (`llama-speculative-simple`), `bench.kernels.prefill` against its prompt processing
(`llama-bench`). Those are not shipped by the Python package, so they are built here: the source
distribution of the installed llama-cpp-python version is fetched with pip (the package index is
the only network these machines reach), its `vendor/llama.cpp` configured with CMake (native CPU
flags, no CURL, static libraries) and the three targets built, about five minutes on two cores.
The result is cached in `<treespec cache>/llama.cpp/<version>/`, outside the repository, and
reused; a build is written to a temporary folder and renamed.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from shared.model_store import cache_dir, pip_extra_args

TOOLS = ("llama-completion", "llama-speculative-simple", "llama-bench")


class ToolBuildError(RuntimeError):
    """llama.cpp's programs could not be built; the message says which step failed and what to do."""


def llama_cpp_version() -> str:
    try:
        return importlib.metadata.version("llama-cpp-python")
    except importlib.metadata.PackageNotFoundError as exc:
        raise ToolBuildError("llama-cpp-python is not installed: pip install 'treespec[edge]'") from exc


def tools_dir(version: str | None = None) -> Path:
    return cache_dir() / "llama.cpp" / (version or llama_cpp_version()) / "bin"


def ensure_tools(progress: bool = True) -> dict[str, Path]:
    """Paths of the llama.cpp programs in TOOLS, built first when they are not cached."""
    version = llama_cpp_version()
    bin_dir = tools_dir(version)
    found = {t: bin_dir / t for t in TOOLS}
    if all(p.is_file() for p in found.values()):
        return found
    root = bin_dir.parent
    root.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".build-{version}.", dir=root.parent))
    try:
        src = _fetch_source(version, work, progress)
        build = work / "build"
        jobs = str(os.cpu_count() or 2)
        _run(
            [
                "cmake",
                "-S",
                str(src),
                "-B",
                str(build),
                "-DCMAKE_BUILD_TYPE=Release",
                "-DGGML_NATIVE=ON",
                "-DLLAMA_CURL=OFF",
                "-DBUILD_SHARED_LIBS=OFF",
                "-DLLAMA_BUILD_TESTS=OFF",
                "-DLLAMA_BUILD_SERVER=OFF",
            ],
            "configure llama.cpp (cmake)",
            progress,
        )
        _run(
            ["cmake", "--build", str(build), "--config", "Release", "-j", jobs, "--target", *TOOLS],
            f"build {', '.join(TOOLS)} (about five minutes on two cores)",
            progress,
        )
        out = work / "out" / "bin"
        out.mkdir(parents=True)
        for t in TOOLS:
            made = next((p for p in build.rglob(t) if p.is_file()), None)  # tools/<t> is also a folder
            if made is None or not made.is_file():
                raise ToolBuildError(f"the build produced no {t}; see the cmake output above")
            shutil.copy2(made, out / t)
        shutil.rmtree(root, ignore_errors=True)
        os.replace(work / "out", root)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {t: bin_dir / t for t in TOOLS}


def _fetch_source(version: str, work: Path, progress: bool) -> Path:
    if shutil.which("cmake") is None:
        raise ToolBuildError("building llama.cpp needs cmake (apt-get install cmake, or pip install cmake)")
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--no-binary",
            ":all:",
            "--no-cache-dir",
            "--quiet",
            "--dest",
            str(work),
            *pip_extra_args(),
            f"llama-cpp-python=={version}",
        ],
        f"fetch the llama-cpp-python {version} source distribution",
        progress,
    )
    archives = list(work.glob("llama_cpp_python-*.tar.gz"))
    if not archives:
        raise ToolBuildError(f"pip left no llama_cpp_python-{version}.tar.gz in {work}")
    with tarfile.open(archives[0]) as tar:
        tar.extractall(work / "src", filter="data")
    src = next((work / "src").glob("llama_cpp_python-*/vendor/llama.cpp"), None)
    if src is None or not (src / "CMakeLists.txt").is_file():
        raise ToolBuildError("the source distribution has no vendor/llama.cpp")
    return src


def _run(cmd: list[str], what: str, progress: bool) -> None:
    if progress:
        print(f"[llama.cpp] {what} ...", file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
        raise ToolBuildError(f"could not {what} (exit {proc.returncode}):\n{tail}")
