"""bench.registry is the one list of runnable benches: every row's module exists and answers
--help, every runnable module of bench/ has a row, and `python -m bench` lists them all without
importing any of them."""

from __future__ import annotations

import contextlib
import importlib
import io
import subprocess
import sys
from pathlib import Path

import pytest

from bench import registry
from bench.__main__ import main as bench_main
from bench.lib import runner

BENCH = Path(__file__).resolve().parents[2] / "bench"


def runnable_modules() -> set[str]:
    """bench.<folder>.<name> for every module under bench/ that runs as a program."""
    return {
        "bench." + ".".join(p.relative_to(BENCH).with_suffix("").parts)
        for p in BENCH.rglob("*.py")
        if "results" not in p.parts and 'if __name__ == "__main__":' in p.read_text(encoding="utf-8")
    }


def test_every_runnable_module_has_a_row_and_every_row_a_module() -> None:
    rows = {e.module for e in registry.BENCHMARKS.values()}
    assert rows == runnable_modules() - {"bench.__main__"}
    for e in registry.BENCHMARKS.values():
        folder = registry.FOLDER[e.kind]
        assert (BENCH / folder / f"{e.name}.py").is_file() and e.module == f"bench.{folder}.{e.name}"


def test_only_the_library_and_the_tool_itself_are_flat() -> None:
    """Every module sits in its kind's folder: bench/ itself holds the tool and the harness."""
    flat = {p.name for p in BENCH.glob("*.py")}
    assert flat == {"__init__.py", "__main__.py", "registry.py", "harness.py"}
    folders = {p.name for p in BENCH.iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    assert folders == {*registry.FOLDER.values(), "lib"}


def test_a_short_name_is_the_module_in_its_folder() -> None:
    """`bench.network` (as `python -m bench.network` and the README spell it) is the very module
    bench.end_to_end.network; one short name names one module."""
    import bench.network as short

    import bench.end_to_end.network as real

    assert short is real
    stems = [p.stem for p in BENCH.rglob("*.py") if "results" not in p.parts and p.parent != BENCH]
    stems = [s for s in stems if s != "__init__"]
    assert len(stems) == len(set(stems)), sorted(s for s in stems if stems.count(s) > 1)


def test_python_dash_m_runs_a_short_name() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "bench.netproxy", "--help"], capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 0 and "usage:" in run.stdout, run.stderr
    run = subprocess.run(
        [sys.executable, "-m", "bench.no_such_module"], capture_output=True, text=True, timeout=60
    )
    assert run.returncode != 0 and "No module named bench.no_such_module" in run.stderr


# developer tools that are not measurements: a long-running server has no result to return
PLAIN_MAIN = {"netproxy": "a TCP delay proxy that runs until it is stopped"}


@pytest.mark.parametrize("name", sorted(registry.RUNNABLE))
def test_every_benchmark_is_add_args_and_run_under_the_runner(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its flags from add_args, its measurement from run -> Result, and its main the runner's: main
    hands the module itself to bench.lib.runner.main (which parses, prints, writes --json and the
    plot)."""
    if name in PLAIN_MAIN:
        return
    module = importlib.import_module(registry.RUNNABLE[name].module)
    assert callable(module.add_args) and callable(module.run)
    runner.build_parser(module)  # add_args declares its flags on a fresh parser without error
    seen: list[object] = []

    def fake_main(mod: object, argv: object = None, **kw: object) -> int:
        seen.append(mod)
        return 0

    monkeypatch.setattr(runner, "main", fake_main)
    assert module.main(["--help"]) == 0
    assert len(seen) == 1 and seen[0] in (module.__name__, module)


def test_every_row_has_a_known_kind_and_a_one_line_summary() -> None:
    for e in registry.BENCHMARKS.values():
        assert e.kind in registry.KINDS and e.summary and "\n" not in e.summary
    assert set(registry.BENCHMARKS).isdisjoint(registry.ENTRY_POINTS)


@pytest.mark.parametrize("name", sorted(registry.RUNNABLE))
def test_every_row_answers_help(name: str) -> None:
    module = importlib.import_module(registry.RUNNABLE[name].module)
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_:
        module.main(["--help"])
    assert exit_.value.code == 0 and "usage:" in out.getvalue()


def test_the_listing_prints_every_row_and_imports_no_bench() -> None:
    code = (
        "import sys; from bench.__main__ import main; rc = main([]);"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy')"
        " or (m.startswith('bench.') and m not in ('bench.__main__', 'bench.registry')));"
        "print('HEAVY', heavy); sys.exit(rc)"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert "HEAVY []" in run.stdout
    lines = run.stdout.splitlines()
    for e in registry.RUNNABLE.values():
        assert any(line.split()[:1] == [e.name] and e.summary in line for line in lines), e.name
    for kind in registry.KINDS:
        assert f"{kind}:" in lines


def test_an_unknown_name_fails_naming_the_choices() -> None:
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert bench_main(["no_such_bench"]) == 2
    text = err.getvalue()
    assert "no_such_bench" in text and all(name in text for name in registry.RUNNABLE)


def test_a_name_runs_its_modules_main(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[list[str]] = []

    def fake_main(argv: list[str]) -> int:
        seen.append(list(argv))
        return 3

    monkeypatch.setattr(importlib.import_module("bench.tools.netproxy"), "main", fake_main)
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    assert bench_main(["netproxy", "--listen", "1"]) == 3
    assert seen == [["--listen", "1"]]
