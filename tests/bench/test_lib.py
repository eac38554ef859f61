"""bench.lib: the median, the nearest-rank percentile, the timed median, the model and common flags,
the result file and its envelope, plots, pinned children; bench.harness, which re-exports it, stays
light."""

from __future__ import annotations

import argparse
import ast
import json
from enum import Enum
from pathlib import Path

import pytest

from bench import harness
from bench.harness import RESULT_KEYS, add_common_args, figure_rows, save_figure, write_json, write_result
from bench.lib.args import add_model_args
from bench.lib.stats import median, median_ms, percentile


def test_median_rounds_when_asked_and_is_none_when_empty() -> None:
    assert median([3.0, 1.0, 2.0]) == 2.0 and median(iter([1.0, 2.0])) == 1.5
    assert median([1.0, 2.0, 2.12345], 2) == 2.0 and median([0.123456], 4) == 0.1235
    assert median([]) is None and median([], 1) is None


def test_percentile_is_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert (
        percentile(values, 50) == 50.0 and percentile(values, 99) == 99.0 and percentile(values, 100) == 100.0
    )
    assert percentile([7.0], 99) == 7.0 and percentile([], 50) is None


def test_median_ms_warms_up_and_syncs_around_each_timed_call() -> None:
    calls: list[str] = []
    ms = median_ms(lambda: calls.append("f"), 3, warmup=2, sync=lambda: calls.append("s"))
    assert ms >= 0.0 and calls == ["f", "f"] + ["s", "f", "s"] * 3


def test_add_model_args_declares_only_what_is_asked_with_its_help() -> None:
    ap = argparse.ArgumentParser()
    add_model_args(ap, model="m", draft="d", draft_help="the draft", threads=2)
    a = ap.parse_args([])
    assert (a.model, a.draft, a.threads) == ("m", "d", 2)
    assert ap.parse_args(["--threads", "3"]).threads == 3
    text = " ".join(ap.format_help().split())
    assert (
        "target model of the verifier" in text
        and "the draft" in text
        and "torch threads (0: torch's default)" in text
    )
    ap = argparse.ArgumentParser()
    add_model_args(ap, threads=0)
    assert vars(ap.parse_args([])) == {"threads": 0}
    with pytest.raises(SystemExit):
        ap.parse_args(["--model", "x"])


def test_pinned_children_run_on_the_given_cores() -> None:
    import os
    import subprocess
    import sys

    from bench.lib.procs import pinned

    if not hasattr(os, "sched_getaffinity"):
        pytest.skip("no CPU affinity here")
    core = min(os.sched_getaffinity(0))
    code = "import os; print(sorted(os.sched_getaffinity(0)))"
    run = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, preexec_fn=pinned([core])
    )
    assert run.stdout.strip() == f"[{core}]"


# ------------------------------------------------------------------------------ args and results
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
    """harness (bench.lib's args, results and procs) is imported by every bench: no torch, matplotlib
    or transformers at import time."""
    import subprocess
    import sys

    code = "import sys, bench.harness; print(sorted({m.split('.')[0] for m in sys.modules}))"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    loaded = set(ast.literal_eval(run.stdout.strip()))
    assert not loaded & {"torch", "matplotlib", "transformers"}, sorted(loaded & {"torch", "matplotlib"})
    assert harness.RESULT_KEYS == ("config", "rows", "complete")
