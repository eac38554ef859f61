"""The repository is the whole story: no source, test, script or build file reads a path outside it.

A user's clone has nothing beside it, so a file that reaches above the repository root (the prompt
sets once lived in a folder beside the checkout) works on a developer's machine and fails on
theirs. Two checks over every tracked file:

- Python: paths built from `__file__` are followed through `.parent`, `.parents[k]`,
  `os.path.dirname` and `/ "..."`, including module-level names bound to them (`REPO =
  Path(__file__).resolve().parents[1]`, then `REPO.parent / "x"`); any that climbs above the root
  is reported.
- Every text file: a string of `../` steps that leaves the repository is reported, read from the
  file's folder for JavaScript and HTML (module imports) and from the root for the rest (every
  script, make and pytest run there).
"""

from __future__ import annotations

import ast
import json
import posixpath
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TEXT_SUFFIXES = {".py", ".sh", ".ts", ".js", ".mjs", ".toml", ".yaml", ".yml", ".cfg", ".ini", ".html"}
TEXT_NAMES = {"Makefile", "run"}
# a quoted or bare path made of ../ steps: '../x', "../../y/z", ../kit
DOTDOT = re.compile(r"""(?:(?<=["'\s=(:])|^)((?:\.\./)+[\w.\-/]*)""", re.M)


@dataclass(frozen=True)
class Escape:
    path: str
    line: int
    what: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.what}"


def tracked_files(root: Path) -> list[str]:
    """Paths relative to root of the files git tracks (a plain copy without .git: every file not in
    an ignored tool folder)."""
    try:
        out = subprocess.run(["git", "ls-files"], cwd=root, capture_output=True, text=True, check=True).stdout
        return [line for line in out.splitlines() if line]
    except (OSError, subprocess.CalledProcessError):
        skip = {".git", ".venv", "node_modules", "__pycache__", ".mypy_cache", ".pytest_cache", ".ruff_cache"}
        return [str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and not skip & set(p.parts)]


def _is_text(rel: str) -> bool:
    p = Path(rel)
    return p.suffix in TEXT_SUFFIXES or p.name in TEXT_NAMES or p.name.startswith("Containerfile")


class _PathDepth(ast.NodeVisitor):
    """Evaluates path expressions rooted at `__file__` to their depth below the repository root
    (the root is 0, `bench/harness.py` is 2) and records every one that goes below 0."""

    def __init__(self, rel: str) -> None:
        self.rel = rel
        self.file_depth = len(Path(rel).parts)
        self.names: dict[str, int] = {}
        self.escapes: list[Escape] = []

    def depth(self, node: ast.expr) -> int | None:
        if isinstance(node, ast.Name):
            if node.id == "__file__":
                return self.file_depth
            return self.names.get(node.id)
        if isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Name) and f.id in {"Path", "PurePath"} and len(node.args) == 1:
                return self.depth(node.args[0])
            if isinstance(f, ast.Attribute):
                if f.attr in {"resolve", "absolute", "expanduser"}:
                    return self.depth(f.value)
                if f.attr in {"dirname", "abspath", "realpath"} and node.args:
                    inner = self.depth(node.args[0])
                    return None if inner is None else inner - (f.attr == "dirname")
                if f.attr == "join" and node.args:
                    return self._join(self.depth(node.args[0]), node.args[1:])
            return None
        if isinstance(node, ast.Attribute) and node.attr == "parent":
            inner = self.depth(node.value)
            return None if inner is None else inner - 1
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute):
            if node.value.attr == "parents" and isinstance(node.slice, ast.Constant):
                inner = self.depth(node.value.value)
                k = node.slice.value
                return None if inner is None or not isinstance(k, int) else inner - (k + 1)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            return self._join(self.depth(node.left), [node.right])
        return None

    def _join(self, base: int | None, parts: list[ast.expr]) -> int | None:
        if base is None:
            return None
        for part in parts:
            if not (isinstance(part, ast.Constant) and isinstance(part.value, str)):
                return base + 1  # a computed name: one level down, as far as can be told
            for step in part.value.split("/"):
                if step == "..":
                    base -= 1
                    if base < 0:
                        return base
                elif step not in ("", "."):
                    base += 1
        return base

    def generic_visit(self, node: ast.AST) -> None:
        if isinstance(node, ast.expr) and not isinstance(node, ast.Name):
            d = self.depth(node)
            if d is not None and d < 0:
                what = f"{ast.unparse(node)} reaches {-d} folder(s) above the repository root"
                self.escapes.append(Escape(self.rel, getattr(node, "lineno", 0), what))
                return
        super().generic_visit(node)

    def visit_Assign(self, node: ast.Assign) -> None:
        self.generic_visit(node)
        d = self.depth(node.value)
        for t in node.targets:
            if isinstance(t, ast.Name) and d is not None:
                self.names[t.id] = d

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        self.generic_visit(node)
        if node.value is not None and isinstance(node.target, ast.Name):
            d = self.depth(node.value)
            if d is not None:
                self.names[node.target.id] = d


def python_escapes(rel: str, source: str) -> list[Escape]:
    v = _PathDepth(rel)
    v.visit(ast.parse(source, filename=rel))
    return v.escapes


def dotdot_escapes(rel: str, text: str) -> list[Escape]:
    """Strings of `../` steps that leave the repository (from the file's folder for JavaScript and
    HTML, from the root for the rest)."""
    out: list[Escape] = []
    base = _module_folder(rel) if Path(rel).suffix in {".ts", ".js", ".mjs", ".html"} else "."
    for m in DOTDOT.finditer(text):
        target = m.group(1)
        if posixpath.normpath(posixpath.join(base, target)).startswith(".."):
            out.append(Escape(rel, text.count("\n", 0, m.start()) + 1, f"{target!r} leaves the repository"))
    return out


def _module_folder(rel: str, root: Path = ROOT) -> str:
    """Where a module runs from: its own folder, or for TypeScript the folder tsc writes it to (the
    nearest tsconfig.json's outDir, relative paths in the compiled file resolve from there)."""
    folder = Path(rel).parent
    if Path(rel).suffix == ".ts":
        for pkg in [folder, *folder.parents]:
            cfg = root / pkg / "tsconfig.json"
            if cfg.is_file():
                opts = json.loads(cfg.read_text(encoding="utf-8")).get("compilerOptions", {})
                out, src = opts.get("outDir"), opts.get("rootDir", ".")
                if out:
                    inside = posixpath.relpath(str(folder), posixpath.join(str(pkg), src))
                    return posixpath.normpath(posixpath.join(str(pkg), out, inside))
                break
    return str(folder)


SELF = "tests/test_repository_paths.py"  # holds examples of what the check must find


def escapes(root: Path) -> list[Escape]:
    found: list[Escape] = []
    for rel in tracked_files(root):
        if rel == SELF or not _is_text(rel) or not (root / rel).is_file():
            continue
        text = (root / rel).read_text(encoding="utf-8", errors="replace")
        if rel.endswith(".py"):
            found += python_escapes(rel, text)
        found += dotdot_escapes(rel, text)
    return found


def test_no_file_refers_to_a_path_outside_the_repository() -> None:
    assert (ROOT / SELF).resolve() == Path(__file__).resolve()  # the one file left out is this one
    found = escapes(ROOT)
    assert not found, "files that read outside the repository:\n" + "\n".join(map(str, found))


@pytest.mark.parametrize(
    ("rel", "source"),
    [
        ("bench/x.py", 'P = Path(__file__).resolve().parents[1].parent / "shared" / "data"\n'),
        ("bench/x.py", 'REPO = Path(__file__).resolve().parents[1]\nP = REPO.parent / "shared"\n'),
        ("tests/a/b.py", "K = Path(__file__).resolve().parents[3] / 'shared'\n"),
        ("bench/x.py", 'P = os.path.join(os.path.dirname(os.path.dirname(__file__)), "..", "kit")\n'),
        ("bench/x.py", 'P = Path(__file__).parent / "../../kit"\n'),
    ],
)
def test_the_check_finds_paths_that_climb_out(rel: str, source: str) -> None:
    assert python_escapes(rel, source), source


@pytest.mark.parametrize(
    ("rel", "source"),
    [
        ("bench/x.py", 'DATA = Path(__file__).resolve().parents[1] / "bench" / "data"\n'),
        ("tests/a/b.py", "ROOT = Path(__file__).resolve().parent.parent.parent\n"),
        ("bench/x.py", "def f(tree):\n    return tree.parents[3]\n"),
    ],
)
def test_the_check_passes_paths_inside(rel: str, source: str) -> None:
    assert not python_escapes(rel, source), source


def test_the_check_finds_dotdot_strings_that_leave() -> None:
    assert dotdot_escapes("bench/x.py", 'p = "../kit/data/prompts"\n')  # leaves from the root
    assert dotdot_escapes(".ci/run", "cat ../../kit/x\n")
    assert not dotdot_escapes("clients/typescript/test/a.ts", 'import { x } from "../src/a";\n')
    # compiled to clients/typescript/dist/test: four steps up is the root, five leave it
    assert not dotdot_escapes("clients/typescript/test/a.ts", 'new URL("../../../../tests/v/", u)\n')
    assert dotdot_escapes("clients/typescript/test/a.ts", 'new URL("../../../../../kit/", u)\n')
    assert not dotdot_escapes(".ci/run", 'cd "$(dirname "$0")/.."\n')
