"""The conventions no structure carries, by a scan of the benches' syntax trees: the shared flags
come from bench.lib.args.add_common_args (declared there once, each module keeping its --seed and
--tokens defaults), every result file from write_result ({"config", "rows", "complete"} and the
bench's own keys), no bench takes another's private names; the exceptions are listed with their
reasons. That every bench is listed and answers --help is bench/registry.py's (test_registry.py);
the library's own behaviour is test_lib.py's."""

from __future__ import annotations

import ast
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.harness import RESULT_KEYS

BENCH = Path(__file__).resolve().parents[2] / "bench"
SHARED_FLAGS = ("--json", "--seed", "--tokens", "--prompt-file", "--no-progress")
# keyword of add_common_args -> its flag
KEYWORD_FLAGS = {
    "json": "--json",
    "seed": "--seed",
    "tokens": "--tokens",
    "prompt_file": "--prompt-file",
    "no_progress": "--no-progress",
}

# (module, function) -> why json.dump / json.dumps is used there outside print(...) (printing is
# always allowed: it writes no file)
JSON_CALLS_ALLOWED = {
    (
        "gpu_check",
        "run_planned",
    ): "one log line (OUTDIR/gpu_check.log) naming the environment, not a JSON file",
    ("browser", "call"): "a DevTools protocol message to Chromium over its WebSocket, not a file",
    ("fuzz", "render_table"): "a figure that is a mapping, shown as JSON text in a table cell, not a file",
    ("parallel", "run"): "the result printed under the table when there is no --json, not a file",
    ("js_edge", "run"): "a JavaScript string literal (the page's URL) in an expression Chromium evaluates",
    ("lookup_tau", "run"): "the summary's figures as one JSON line of the printed text, not a file",
}
# (module, function) -> which non-result JSON file it writes with harness.write_json, and who reads it
WRITE_JSON_ALLOWED = {
    (
        "drafter_cost",
        "run",
    ): "the curve files beside --json ({rows: [row counts], ms}): bench.simulation.simulate's "
    "--drafter-curve input, whose 'rows' are row counts, not result rows",
    ("load_cost", "save_scripts"): "the recorded scripts (--scripts): this bench's own input on a later run",
    ("network_report", "write_trace"): "the round traces (--trace): bench.simulation.simulate's input",
}


def bench_modules() -> list[Path]:
    """The tool's own files, every module in a kind's folder (not the library, bench/lib) and the
    demo, which takes the same common arguments."""
    flat = [p for p in BENCH.glob("*.py") if p.name not in ("__init__.py", "harness.py")]
    foldered = [
        p for p in BENCH.glob("*/*.py") if p.name != "__init__.py" and p.parent.name not in ("lib", "results")
    ]
    demo = BENCH.parent / "treespec_demo" / "demo.py"
    return sorted([*flat, *foldered, demo], key=lambda p: p.stem)


def module_path(stem: str) -> Path:
    """The file of the bench module named `stem` (stems are unique across the folders)."""
    return next(p for p in bench_modules() if p.stem == stem)


def parsed(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def _called(node: ast.Call) -> str:
    f = node.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""


def walk_calls(tree: ast.Module) -> Iterator[tuple[ast.Call, str, bool]]:
    """Every call with the innermost function it is in ("" at module level) and whether it sits
    inside the arguments of a print(...)."""

    def visit(node: ast.AST, func: str, in_print: bool) -> Iterator[tuple[ast.Call, str, bool]]:
        for child in ast.iter_child_nodes(node):
            f, p = func, in_print
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                f = child.name
            if isinstance(child, ast.Call):
                yield child, f, p
                p = p or _called(child) == "print"
            yield from visit(child, f, p)

    yield from visit(tree, "", False)


def is_json_dump(call: ast.Call) -> bool:
    f = call.func
    return (
        isinstance(f, ast.Attribute)
        and isinstance(f.value, ast.Name)
        and f.value.id == "json"
        and f.attr in ("dump", "dumps")
    )


def common_args_calls(tree: ast.Module) -> list[ast.Call]:
    return [c for c, _, _ in walk_calls(tree) if _called(c) == "add_common_args"]


def flags_of(call: ast.Call) -> set[str]:
    """The flags one add_common_args call declares; its keywords must be literals (so this scan,
    and a reader, can see them)."""
    out = set()
    for kw in call.keywords:
        if kw.arg in KEYWORD_FLAGS:
            assert isinstance(kw.value, ast.Constant), f"add_common_args({kw.arg}=...) must be a literal"
            if kw.value.value is not None and kw.value.value is not False:
                out.add(KEYWORD_FLAGS[kw.arg])
    return out


def declared_flags() -> dict[str, set[str]]:
    """Per bench module, the shared flags its add_common_args call(s) declare."""
    out: dict[str, set[str]] = {}
    for path in bench_modules():
        calls = common_args_calls(parsed(path))
        if calls:
            out[path.stem] = set().union(*(flags_of(c) for c in calls))
    return out


def flag_offenders(name: str, tree: ast.Module) -> list[str]:
    """Where a module declares one of the shared flags itself."""
    out = []
    for call, func, _ in walk_calls(tree):
        strings = [a.value for a in call.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
        if _called(call) == "add_argument" and set(strings) & set(SHARED_FLAGS):
            out.append(f"{name}.{func}: add_argument({', '.join(strings)})")
        if _called(call) == "add_prompt_file_arg":
            out.append(f"{name}.{func}: add_prompt_file_arg (use add_common_args)")
    return out


def json_offenders(name: str, tree: ast.Module) -> list[str]:
    """Where a module writes JSON past the harness: json.dump / json.dumps outside print(...) and
    the listed exceptions, `from json import ...`, write_json outside the listed exceptions."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "json":
            out.append(f"{name}: from json import {', '.join(a.name for a in node.names)}")
    for call, func, in_print in walk_calls(tree):
        if is_json_dump(call) and not in_print and (name, func) not in JSON_CALLS_ALLOWED:
            out.append(f"{name}.{func}: json.{_called(call)} (results: harness.write_result)")
        if _called(call) == "write_json" and (name, func) not in WRITE_JSON_ALLOWED:
            out.append(f"{name}.{func}: write_json (results: harness.write_result)")
    return out


# ------------------------------------------------------------------------------ the AST scan
def test_no_module_declares_a_shared_flag_itself() -> None:
    offenders = [o for path in bench_modules() for o in flag_offenders(path.stem, parsed(path))]
    assert offenders == [], "declare these through bench.harness.add_common_args"


def test_no_module_writes_json_past_the_harness() -> None:
    offenders = [o for path in bench_modules() for o in json_offenders(path.stem, parsed(path))]
    assert offenders == [], "write results with bench.harness.write_result"


def test_the_scan_sees_what_it_must_refuse() -> None:
    """The scan on made-up modules: each way round the harness is caught, printing is not."""
    src = """
def main():
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("-t", "--tokens", type=int, default=64)
    add_prompt_file_arg(ap)
    Path(a.json).write_text(json.dumps(result, indent=2))
    text = json.dumps(result)
    with open(a.json, "w") as f:
        json.dump(result, f)
    write_json(a.json, result)
    print(json.dumps(result))
    print(table([[k, json.dumps(v)] for k, v in result.items()]))
"""
    tree = ast.parse(src)
    assert [o.split(": ", 1)[1] for o in flag_offenders("made_up", tree)] == [
        "add_argument(--seed)",
        "add_argument(-t, --tokens)",
        "add_prompt_file_arg (use add_common_args)",
    ]
    assert [o.split(": ", 1)[1].split(" ")[0] for o in json_offenders("made_up", tree)] == [
        "json.dumps",
        "json.dumps",
        "json.dump",
        "write_json",
    ]
    assert json_offenders("m", ast.parse("from json import dumps")) == ["m: from json import dumps"]
    assert json_offenders("gpu_check", ast.parse("def run_planned():\n    log.write(json.dumps(env))")) == []


# per module, the --tokens and --seed defaults it had before the shared flags moved into the harness:
# other work and the README's figures rely on them
DEFAULTS = {
    "agreement": {"tokens": 64},
    "chaos": {"tokens": 64, "seed": 0},
    "colocation": {"tokens": 48},
    "demo": {"tokens": 96},
    "e2e": {"tokens": 128, "seed": 0},
    "fleet": {"tokens": 64, "seed": 0},
    "fleet_autoscale": {"tokens": 192, "seed": 0},
    "fuzz": {"seed": 0},
    "gpu_forward": {"seed": 0},
    "js_edge": {"tokens": 64},
    "load": {"tokens": 64, "seed": 0},
    "load_cost": {"tokens": 64},
    "lookup_tau": {"tokens": 128},
    "merged": {"tokens": 64, "seed": 0},
    "network": {"tokens": 64},
    "offload": {"tokens": 32},
    "outcomes": {"tokens": 64},
    "peers": {"tokens": 64},
    "prefill_share": {"tokens": 64, "seed": 0},
    "serve": {"seed": 0},
    "soak": {"seed": 0},
    "speculators": {"tokens": 64},
    "tree_attention": {"seed": 0},
    "verify_exactness": {"seed": 0},
    "weights_agreement": {"tokens": 64},
}


def test_the_modules_keep_their_defaults() -> None:
    got = {}
    for path in bench_modules():
        for call in common_args_calls(parsed(path)):
            kws = {
                kw.arg: kw.value.value
                for kw in call.keywords
                if kw.arg in ("seed", "tokens") and isinstance(kw.value, ast.Constant)
            }
            if kws:
                got[path.stem] = kws
    assert got == DEFAULTS


def test_the_exceptions_are_still_needed() -> None:
    """An exception whose use is gone must leave the lists (they stay an honest inventory)."""
    used_json, used_write = set(), set()
    for path in bench_modules():
        for call, func, in_print in walk_calls(parsed(path)):
            if is_json_dump(call) and not in_print:
                used_json.add((path.stem, func))
            if _called(call) == "write_json":
                used_write.add((path.stem, func))
    assert set(JSON_CALLS_ALLOWED) <= used_json
    assert set(WRITE_JSON_ALLOWED) <= used_write


def test_the_common_args_are_literal_and_declared_once_per_module() -> None:
    for path in bench_modules():
        calls = common_args_calls(parsed(path))
        assert len(calls) <= 1, f"{path.stem}: one add_common_args call"
        for c in calls:
            flags_of(c)  # asserts the keywords are literals


def test_no_bench_imports_another_modules_private_names() -> None:
    """What two benches share lives in bench/lib under a public name, not in one of them."""
    offenders = []
    for path in [*bench_modules(), BENCH / "harness.py"]:
        for node in ast.walk(parsed(path)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("bench"):
                offenders += [
                    f"{path.stem}: {node.module}.{a.name}" for a in node.names if a.name.startswith("_")
                ]
    assert offenders == []


# ------------------------------------------------------------------------------ the files themselves
CHEAP_RUNS = {  # benches that run in seconds on the tiny model, with the arguments their own tests use
    "target_step": "--model tiny --no-transformers --repeats 1 --prefixes 16 --rows 1,3 --decode-tokens 2 "
    "--no-progress",
    "gpu_forward": "--shape tiny --device cpu --dtype fp32 --rows 1,4 --prefix 8 --repeats 1 --decode-tokens"
    " 2 --attention sdpa",
    "drafter_cost": "--draft tiny --backends torch --rows 1,2 --repeats 1 --no-busy --no-progress",
}


@pytest.mark.parametrize("module", sorted(CHEAP_RUNS))
def test_a_bench_run_writes_the_envelope(module: str, tmp_path: Path) -> None:
    import importlib

    out = tmp_path / "r.json"
    bench = importlib.import_module(f"bench.{module}")
    assert bench.main([*CHEAP_RUNS[module].split(), "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert list(doc)[:3] == list(RESULT_KEYS) and doc["complete"] is True
    assert doc["config"]["json"] == str(out) and doc["rows"] and all(isinstance(r, dict) for r in doc["rows"])
