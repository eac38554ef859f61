"""The verifier's container image, built and smoke-tested (`make image-test`): slow, and only where
a container engine (podman or docker) is installed."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.skipif(
    shutil.which("podman") is None and shutil.which("docker") is None, reason="no podman or docker"
)
def test_verifier_image_serves_exact_tokens() -> None:
    r = subprocess.run(
        ["bash", "scripts/image.sh", "test"], cwd=REPO, capture_output=True, text=True, timeout=3600,
        env={**os.environ, "PYTHON": sys.executable},
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-4000:]
    assert "greedy through the edge client == target-only ar" in r.stdout and ": True" in r.stdout
    assert "must not be 0" in r.stdout
    assert "edge-check: edge image greedy == edge image ar" in r.stdout and "serve --help runs" in r.stdout


# ------------------------------------------------------------------ checks that need no container engine
CONTAINERFILES = sorted((REPO / "docker").glob("Containerfile.*"))
PROJECT = ("shared", "cloud_verifier", "edge_client", "treespec_kernels", "bench")


def _instructions(path: Path) -> list[tuple[str, str]]:
    """(instruction, arguments) of a Containerfile, continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    text = "\n".join(line for line in path.read_text().splitlines() if not line.lstrip().startswith("#"))
    for logical in text.replace("\\\n", " ").splitlines():
        if logical.strip():
            word, _, rest = logical.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def _python_snippets(run: str) -> list[str]:
    """The code of every `python -c "..."` in a RUN line."""
    return [m.group(2) for m in re.finditer(r"python3? -c ([\"'])(.*?)\1", run)]


@pytest.mark.parametrize("path", CONTAINERFILES, ids=lambda p: p.name)
def test_containerfiles_copy_files_that_exist(path: Path) -> None:
    ignored = {line.strip() for line in (REPO / ".dockerignore").read_text().splitlines() if line.strip()}
    for word, args in _instructions(path):
        if word == "COPY" and not args.startswith("--from"):
            *sources, _dest = args.split()
            for src in sources:
                assert (REPO / src).exists(), f"{path.name}: COPY {src}: no such path in the repository"
                assert src.split("/")[0] not in ignored, f"{path.name}: COPY {src} is in .dockerignore"


@pytest.mark.parametrize("path", CONTAINERFILES, ids=lambda p: p.name)
def test_containerfiles_name_modules_that_exist(path: Path) -> None:
    """The Python a Containerfile runs at build time names modules and attributes of the project
    that exist (the verifier image once imported a module that had moved)."""
    names: list[tuple[str, str | None]] = []
    for word, args in _instructions(path):
        if word not in {"RUN", "CMD", "HEALTHCHECK", "ENTRYPOINT"}:
            continue
        names += [(m, None) for m in re.findall(r"python3? -m ([\w.]+)", args)]
        for code in _python_snippets(args):
            for node in ast.walk(ast.parse(code)):
                if isinstance(node, ast.ImportFrom) and node.module:
                    names += [(node.module, a.name) for a in node.names]
                elif isinstance(node, ast.Import):
                    names += [(a.name, None) for a in node.names]
    project = [(m, attr) for m, attr in names if m.split(".")[0] in PROJECT]
    assert project or "verifier" not in path.name, "the verifier image is expected to import the kernels"
    for module, attr in project:
        spec = importlib.util.find_spec(module)
        assert spec is not None, f"{path.name}: module {module} does not exist"
        if attr is not None:
            mod = importlib.import_module(module)
            sub = importlib.util.find_spec(f"{module}.{attr}") if hasattr(mod, "__path__") else None
            assert hasattr(mod, attr) or sub is not None, f"{path.name}: {module} has no {attr}"


def _import_check(*packages: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(REPO / "scripts" / "import_check.py"), *packages],
        cwd=cwd, capture_output=True, text=True, timeout=600,
        env={**os.environ, "PYTHONPATH": str(cwd)},
    )  # fmt: skip


def test_every_module_of_the_project_imports() -> None:
    r = _import_check(*PROJECT)
    assert r.returncode == 0, r.stderr[-4000:]
    assert "0 failed" in r.stdout


def test_the_import_check_fails_on_a_moved_module_and_skips_a_missing_extra(tmp_path: Path) -> None:
    pkg = tmp_path / "shared"  # a project package name: a missing module under it is a moved module
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "fine.py").write_text("X = 1\n")
    (pkg / "extra.py").write_text("import no_such_optional_dependency\n")
    (pkg / "moved.py").write_text("from shared.gone import thing\n")
    r = _import_check("shared", cwd=tmp_path)
    assert r.returncode == 1
    assert "FAILED  shared.moved" in r.stderr and "shared.gone" in r.stderr
    assert "skipped shared.extra (needs no_such_optional_dependency" in r.stdout
    assert "2 modules imported, 1 skipped, 1 failed" in r.stdout
