"""bench.speculators: the Wilson interval and McNemar's exact test give the textbook values, the
coverage table and the paired comparison count what they say, and a run over `tiny` records with
one draft twice finds no difference (p = 1)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from bench.harness import BenchPrompt
from bench.speculators import compare, learning_curve, main, mcnemar, table1, wilson
from draft_training.collect import CollectConfig, collect
from shared.model import load_target


def test_wilson_and_mcnemar() -> None:
    lo, hi = wilson(8, 10)
    assert (round(lo, 3), round(hi, 3)) == (0.49, 0.943)  # the textbook 8 of 10
    assert wilson(0, 10)[0] == 0.0 and wilson(10, 10)[1] == 1.0 and wilson(0, 0) == (0.0, 1.0)
    assert mcnemar(0, 5) == pytest.approx(2 / 32)  # all five discordant pairs one way
    assert mcnemar(3, 3) == 1.0 and mcnemar(0, 0) == 1.0
    assert mcnemar(10, 30) == pytest.approx(0.00222, abs=1e-5)
    assert mcnemar(700, 900) < 1e-6 and mcnemar(800, 800) == 1.0  # thousands of pairs: no overflow


def test_coverage_rows_and_the_paired_comparison() -> None:
    recs = [
        {"name": "a", "category": "qa", "temperature": 0.0},
        {"name": "b", "category": "code", "temperature": 0.0},
        {"name": "c", "category": "qa", "temperature": 1.0},
    ]
    base = {"a": np.array([0, 1, 5]), "b": np.array([0, 0]), "c": np.array([2])}
    other = {"a": np.array([0, 0, 0]), "b": np.array([1, 0]), "c": np.array([0])}
    rows = {(r["temperature"], r["category"]): r for r in table1(recs, base)}
    qa = rows[(0.0, "qa")]
    assert qa["top1"] == pytest.approx(1 / 3, abs=1e-4) and qa["top2"] == pytest.approx(2 / 3, abs=1e-4)
    assert rows[(0.0, "all")]["n"] == 5 and rows[(0.0, "all")]["top1"] == pytest.approx(3 / 5)
    assert rows[(1.0, "all")]["top3"] == 1.0 and rows[(1.0, "all")]["top2"] == 0.0
    (t0, t1) = compare(recs, base, other)
    assert (t0["only_base"], t0["only_other"], t0["n"]) == (1, 2, 5) and t0["points"] == pytest.approx(20.0)
    assert (t1["only_base"], t1["only_other"]) == (0, 1)


def test_a_run_on_tiny_records(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    teacher = load_target("tiny", progress=False)
    prompts = [BenchPrompt(i, "qa", f"question {i}: what is {i} plus {i + 1}?") for i in range(3)]
    collect(tmp_path / "held", prompts, CollectConfig("tiny", tokens=8, temperatures=(0.0, 1.0)),
            target=teacher, progress=False)  # fmt: skip
    run = tmp_path / "run"
    run.mkdir()
    (run / "train.json").write_text(
        json.dumps({"distill": {"batch": 4}, "records_manifest": {"tokens": 8},
                    "evals": [{"step": 0, "top1": 0.1, "tau": 1.1}, {"step": 10, "top1": 0.3, "tau": 1.4}]})
    )  # fmt: skip
    assert learning_curve(run)[1] == {"step": 10, "train_tokens": 320, "top1": 0.3, "tau": 1.4}
    out = tmp_path / "s.json"
    args = ["--records", str(tmp_path / "held"), "--drafts", "tiny,tiny", "--backends", "torch"]
    assert main([*args, "--curve", str(run), "--json", str(out), "--no-progress"]) == 0
    doc = json.loads(out.read_text())
    assert {r["temperature"] for r in doc["rows"]} == {0.0, 1.0} and doc["complete"]
    # the tiny draft is the teacher itself: its top-1 is the greedy token everywhere
    greedy = [r for r in doc["rows"] if r["temperature"] == 0.0 and r["category"] == "all"]
    assert greedy[0]["top1"] == 1.0
    assert all(c["p"] == 1.0 and c["points"] == 0.0 for c in doc["comparisons"])
    assert len(doc["learning_curve"]) == 2 and "McNemar" in capsys.readouterr().out
    # DRAFT@lora=FILE runs on llama.cpp only: skipped on torch, and so left out of the comparisons
    args = ["--records", str(tmp_path / "held"), "--drafts", f"tiny,tiny@lora={tmp_path / 'a.gguf'}"]
    assert main([*args, "--backends", "torch", "--json", str(out), "--no-progress"]) == 0
    doc = json.loads(out.read_text())
    assert {r["draft"] for r in doc["rows"]} == {"tiny"} and doc["comparisons"] == []
