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

BENCH = Path(__file__).resolve().parents[2] / "bench"


def runnable_modules() -> set[str]:
    return {
        p.stem for p in BENCH.glob("*.py") if 'if __name__ == "__main__":' in p.read_text(encoding="utf-8")
    }


def test_every_runnable_module_has_a_row_and_every_row_a_module() -> None:
    rows = {e.module.removeprefix("bench.") for e in registry.RUNNABLE.values()}
    assert rows == runnable_modules() - {"__main__"}
    for e in registry.RUNNABLE.values():
        assert (BENCH / f"{e.name}.py").is_file() and e.module == f"bench.{e.name}"


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

    monkeypatch.setattr(importlib.import_module("bench.netproxy"), "main", fake_main)
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    assert bench_main(["netproxy", "--listen", "1"]) == 3
    assert seen == [["--listen", "1"]]
