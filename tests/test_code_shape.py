"""Shape goals a reader relies on: the engine step reads top to bottom in at most 40 lines, the
engine's and the step runner's signatures say what they take (no `Any`), and no function is over
80 lines outside argument parsers written flag by flag (names ending in `_parser` or `build_parser`,
outside the modules whose parsers are generated from config dataclasses), and no source file is
over 600 lines (a longer one is split by job into modules that each read on their own)."""

from __future__ import annotations

import ast
import os
from pathlib import Path

from tests.test_import_cycles import PACKAGES

ROOT = Path(__file__).resolve().parents[1]
# a Triton JIT kernel is one function by construction: it cannot call Python helpers
LONG_ALLOWED = {("treespec_kernels/_triton_tree_attention.py", "_tree_attention_fwd")}
# parsers generated from config dataclasses (shared.config_cli) are short: no exemption there
GENERATED_PARSERS = ("cloud_verifier/cli.py", "edge_client/cli_parser.py", "draft_training/cli.py")

MAX_FILE_LINES = 600
SOURCE_SUFFIXES = {".py", ".ts", ".js", ".cpp", ".h"}
# installed packages, tool caches, build outputs (the TypeScript client's dist/ bundle included) and
# stored or scratch results: nothing here is written by hand
SKIP_DIRS = {".git", ".venv", "node_modules", "__pycache__", ".mypy_cache", ".pytest_cache", ".ruff_cache"}
SKIP_DIRS |= {".hypothesis", ".cache", "build", "dist"}
SKIP_PATHS = {"bench/results", "bench/out"}
# files over the limit while they are being split into modules (path -> why), each leaving the list
# with its split; none now (quant_matmul.cpp, speculation/core.py and the TypeScript client.ts were)
LONG_FILES_ALLOWED: dict[str, str] = {}


def functions(path: Path) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def length(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    assert fn.end_lineno is not None
    return fn.end_lineno - fn.lineno + 1


def long_functions(root: Path, packages: tuple[str, ...], limit: int = 80) -> list[str]:
    out = []
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            if "results" in path.relative_to(root).parts:
                continue
            for fn in functions(path):
                parser = fn.name.endswith("_parser") or fn.name == "build_parser"
                parser = parser and rel not in GENERATED_PARSERS
                if length(fn) > limit and not parser and (rel, fn.name) not in LONG_ALLOWED:
                    out.append(f"{rel}:{fn.lineno} {fn.name} ({length(fn)} lines)")
    return out


def _method(path: str, cls: str, name: str) -> ast.FunctionDef:
    tree = ast.parse((ROOT / path).read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == name:
                    return item
    raise AssertionError(f"{path}: no {cls}.{name}")


def test_the_engine_step_reads_in_at_most_40_lines() -> None:
    step = _method("cloud_verifier/step.py", "StepRunner", "step")
    execute = _method("cloud_verifier/step.py", "StepRunner", "execute")
    assert length(step) + length(execute) <= 40, (length(step), length(execute))
    # the stages it names are methods of the runner
    called = {
        n.func.attr
        for n in ast.walk(execute)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
    }
    assert {"forward", "verify", "read", "commit"} <= called


def test_no_any_in_the_engine_and_step_runner_signatures() -> None:
    for path in ("cloud_verifier/engine.py", "cloud_verifier/step.py", "cloud_verifier/step.py"):
        for fn in functions(ROOT / path):
            annotations = [a.annotation for a in (*fn.args.args, *fn.args.kwonlyargs) if a.annotation]
            annotations += [fn.returns] if fn.returns is not None else []
            text = " ".join(ast.unparse(a) for a in annotations)
            assert "Any" not in text.replace("AnyStr", ""), f"{path}: {fn.name}({text})"


def test_the_length_check_sees_a_long_function(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    body = "\n".join(f"    x{i} = {i}" for i in range(85))
    (tmp_path / "pkg" / "m.py").write_text(
        f"def long():\n{body}\n\ndef p_parser():\n{body}\n", encoding="utf-8"
    )
    assert long_functions(tmp_path, ("pkg",)) == ["pkg/m.py:1 long (86 lines)"]


def test_no_function_is_over_80_lines_outside_argument_parsers() -> None:
    found = long_functions(ROOT, PACKAGES)
    assert found == [], "split these (a parser is exempt when named *_parser or build_parser): " + str(found)


def source_files(root: Path) -> list[Path]:
    """The hand-written sources under `root`: *.py, *.ts, *.js, *.cpp, *.h outside SKIP_DIRS and
    SKIP_PATHS."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        rel = here.relative_to(root).as_posix()
        dirnames[:] = [
            d for d in dirnames if d not in SKIP_DIRS and f"{rel}/{d}".removeprefix("./") not in SKIP_PATHS
        ]
        out += [here / f for f in filenames if Path(f).suffix in SOURCE_SUFFIXES]
    return sorted(out)


def long_files(root: Path, limit: int = MAX_FILE_LINES) -> dict[str, int]:
    """Every source file over `limit` lines, by its path under `root`."""
    out = {}
    for path in source_files(root):
        with path.open("rb") as f:
            n = sum(1 for _ in f)
        if n > limit:
            out[path.relative_to(root).as_posix()] = n
    return out


def test_the_file_length_check_sees_a_long_file_and_skips_the_rest(tmp_path: Path) -> None:
    for rel, n in {
        "pkg/long.py": 601,
        "pkg/ok.py": 600,
        "pkg/k.cpp": 700,
        "pkg/notes.md": 900,
        "node_modules/dep/x.js": 900,
        "bench/results/a/r.py": 900,
        "clients/ts/dist/b.js": 900,
    }.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x = 1\n" * n, encoding="utf-8")
    assert long_files(tmp_path) == {"pkg/k.cpp": 700, "pkg/long.py": 601}


def test_no_source_file_is_over_600_lines() -> None:
    found = long_files(ROOT)
    over = {p: n for p, n in found.items() if p not in LONG_FILES_ALLOWED}
    assert over == {}, f"split these by job into modules of at most {MAX_FILE_LINES} lines: {over}"
