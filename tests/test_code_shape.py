"""Shape goals a reader relies on: the engine step reads top to bottom in at most 40 lines, the
engine's and the step runner's signatures say what they take (no `Any`), and no function is over
80 lines outside argument parsers written flag by flag (names ending in `_parser` or `build_parser`,
outside the modules whose parsers are generated from config dataclasses)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("edge_client", "cloud_verifier", "shared", "treespec_kernels", "bench", "draft_training")
# a Triton JIT kernel is one function by construction: it cannot call Python helpers
LONG_ALLOWED = {("treespec_kernels/_triton_tree_attention.py", "_tree_attention_fwd")}
# parsers generated from config dataclasses (shared.config_cli) are short: no exemption there
GENERATED_PARSERS = ("cloud_verifier/cli.py", "edge_client/cli_parser.py")


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
