"""One shape of bench: the shared flags come from bench.harness.add_common_args, every result file
from bench.harness.write_result ({"config", "rows", "complete"} and the bench's own keys), and a
plot's end from save_figure."""

from __future__ import annotations

import argparse
import ast
import json
from enum import Enum
from pathlib import Path

import pytest

from bench import harness
from bench.harness import RESULT_KEYS, add_common_args, figure_rows, save_figure, write_json, write_result

BENCH = Path(__file__).resolve().parents[2] / "bench"


# ------------------------------------------------------------------------------ the helpers
def test_add_common_args_takes_the_modules_defaults() -> None:
    ap = argparse.ArgumentParser()
    add_common_args(
        ap, json=True, seed=7, seed_help="the frames", tokens=128, prompt_file=True, no_progress=True
    )
    a = ap.parse_args([])
    assert (a.json, a.seed, a.tokens, a.prompt_file, a.no_progress) == (None, 7, 128, None, False)
    a = ap.parse_args(["--json", "x/r.json", "--tokens", "5", "--no-progress", "--prompt-file", "p.jsonl"])
    assert (
        a.json == Path("x/r.json") and a.tokens == 5 and a.no_progress and a.prompt_file == [Path("p.jsonl")]
    )
    text = " ".join(ap.format_help().split())
    assert "--json PATH" in text and "--seed N" in text and "seed: the frames" in text
    assert "--prompt-file PATH" in text and "{config, rows, complete}" in text


def test_add_common_args_leaves_out_what_a_module_does_not_take() -> None:
    ap = argparse.ArgumentParser()
    add_common_args(ap, json=True)
    assert vars(ap.parse_args([])) == {"json": None}
    with pytest.raises(SystemExit):
        ap.parse_args(["--seed", "1"])


def test_write_result_writes_the_envelope_and_the_benchs_own_keys(tmp_path: Path) -> None:
    class Kind(Enum):
        TREE = "tree"

    out = tmp_path / "deep" / "r.json"
    config = argparse.Namespace(json=out, prompt_file=[Path("a.jsonl")], kind=Kind.TREE, seed=0)
    rows = [{"mode": "ar", "ms": 1.5}, {"mode": "tree", "ms": float("nan")}]
    assert write_result(out, config, rows, True, records={"ar": [1]}) == out
    doc = json.loads(out.read_text())
    assert list(doc)[:3] == list(RESULT_KEYS) and doc["complete"] is True and doc["records"] == {"ar": [1]}
    assert doc["config"] == {"json": str(out), "prompt_file": ["a.jsonl"], "kind": "tree", "seed": 0}
    assert doc["rows"][0] == {"mode": "ar", "ms": 1.5} and doc["rows"][1]["ms"] != doc["rows"][1]["ms"]
    assert [p.name for p in out.parent.iterdir()] == ["r.json"]  # no temporary file left
    assert write_result(None, {}, [], False) is None


@pytest.mark.parametrize(
    ("config", "rows", "complete", "extra", "error", "message"),
    [
        ({}, [], 1, {}, TypeError, "complete must be a bool"),
        ({}, [], None, {}, TypeError, "complete must be a bool"),
        ([("a", 1)], [], True, {}, TypeError, "config must be a mapping"),
        ({1: "a"}, [], True, {}, TypeError, "config must be a mapping of str keys"),
        ({}, {"a": 1}, True, {}, TypeError, "rows must be a list"),
        ({}, "rows", True, {}, TypeError, "rows must be a list"),
        ({}, [{"a": 1}, [1, 2]], True, {}, TypeError, r"rows\[1\] must be a mapping"),
        ({}, [{2: 1}], True, {}, TypeError, r"rows\[0\] must be a mapping of str keys"),
        ({}, [], True, {"rows": []}, ValueError, "rows: the envelope's own keys"),
        ({}, [{"a": object()}], True, {}, TypeError, "object cannot be written to JSON"),
        ({"s": {1, 2}}, [], True, {}, TypeError, "set cannot be written to JSON"),
    ],
)
def test_write_result_refuses_bad_input_before_touching_the_file(
    tmp_path: Path,
    config: object,
    rows: object,
    complete: object,
    extra: dict[str, object],
    error: type[Exception],
    message: str,
) -> None:
    out = tmp_path / "r.json"
    out.write_text("earlier")
    with pytest.raises(error, match=message):
        write_result(out, config, rows, complete, **extra)  # type: ignore[arg-type]
    assert out.read_text() == "earlier" and [p.name for p in tmp_path.iterdir()] == ["r.json"]


def test_write_result_checks_even_without_a_path() -> None:
    """A run without --json still fails on rows no reader could take (the tests catch it)."""
    with pytest.raises(TypeError, match="rows must be a list"):
        write_result(None, {}, {"a": 1}, True)  # type: ignore[arg-type]


def test_write_json_is_for_other_formats(tmp_path: Path) -> None:
    import numpy as np

    doc = {"rows": [1, 2], "ms": np.array([3.0, 4.0]), "p": Path("x"), "n": np.int64(5)}
    out = write_json(tmp_path / "c" / "curve.json", doc)
    assert json.loads(out.read_text()) == {"rows": [1, 2], "ms": [3.0, 4.0], "p": "x", "n": 5}


def test_figure_rows_are_the_printed_table() -> None:
    assert figure_rows({"kills": 3, "identical": True}) == [
        {"figure": "kills", "value": 3},
        {"figure": "identical", "value": True},
    ]


def test_save_figure_writes_the_png_and_closes_the_figure(tmp_path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    ax.plot([0, 1], [1, 0])
    out = save_figure(fig, tmp_path / "sub" / "p.png", dpi=50)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not plt.fignum_exists(fig.number)


def test_harness_stays_light() -> None:
    """harness is imported by every bench: no torch, no matplotlib at import time."""
    src = (BENCH / "harness.py").read_text()
    top = [n for n in ast.parse(src).body if isinstance(n, (ast.Import, ast.ImportFrom))]
    names = {a.name.split(".")[0] for n in top if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module.split(".")[0] for n in top if isinstance(n, ast.ImportFrom) and n.module}
    assert not names & {"torch", "matplotlib", "numpy", "transformers"}, names
    assert "TYPE_CHECKING" in src and harness.RESULT_KEYS == ("config", "rows", "complete")
