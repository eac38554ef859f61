"""bench.training.speculators: the Wilson interval and McNemar's exact test give the textbook values, the
coverage table and the paired comparison count what they say, and a run over `tiny` records with
one draft twice finds no difference (p = 1)."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from bench.harness import BenchPrompt
from bench.training.speculators import compare, learning_curve, main, mcnemar, table1, wilson
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
    # no records to count from: estimated as steps x batch x tokens a record
    assert learning_curve(run)[1] == {
        "step": 10, "train_tokens": 320, "train_tokens_counted": False, "top1": 0.3, "tau": 1.4
    }  # fmt: skip
    counted = tmp_path / "counted.json"
    evals = [
        {"step": 0, "top1": 0.1, "tau": 1.1, "train_positions": 0},
        {"step": 10, "top1": 0.3, "tau": 1.4, "train_positions": 301},
    ]
    doc = {"distill": {"batch": 4}, "records_manifest": {"tokens": 8}, "evals": evals}
    counted.write_text(json.dumps(doc))
    curve = learning_curve(counted)
    assert [(c["train_tokens"], c["train_tokens_counted"]) for c in curve] == [(0, True), (301, True)]
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


def test_the_e2e_part_on_the_tiny_pair(capsys: pytest.CaptureFixture[str]) -> None:
    """tau and ms/token end to end: a verifier of `tiny` (a child process), the same weights drafting
    in torch; every mode's greedy tokens are ar's, ar's speed-up is 1, and the edge's cores are given
    back afterwards."""
    import argparse
    import os

    from bench.training.speculators import e2e_part, render_e2e

    cores = os.sched_getaffinity(0)
    a = argparse.Namespace(tree="2,1", e2e_backend="torch", tokens=6, no_progress=True)
    prompts = [
        BenchPrompt("q0", "qa", "What is two plus two?"),
        BenchPrompt("c0", "coding", "def f(x):", raw=True),
    ]
    rows = e2e_part("tiny", ["tiny"], prompts, ["ar", "tree", "budget"], a)
    assert os.sched_getaffinity(0) == cores
    by_mode = {r["mode"]: r for r in rows}
    assert set(by_mode) == {"ar", "tree", "budget"} and all(r["draft"] == "tiny" for r in rows)
    assert all(r["identical_to_ar"] is True and r["prompts"] == 2 for r in rows)
    assert by_mode["ar"]["speedup_vs_ar"] == 1.0 and by_mode["ar"]["tau"] == 1.0
    # the draft is the target itself: every drafted token is accepted, so a round commits more than one
    assert by_mode["tree"]["tau"] > 1.5 and by_mode["tree"]["target_forwards_per_token"] < 1
    assert "tokens = ar's" in render_e2e(rows)


def test_parts_and_modes_are_checked() -> None:
    with pytest.raises(SystemExit):
        main(["--parts", "table2", "--no-progress"])
    with pytest.raises(SystemExit):
        main(["--parts", "e2e", "--e2e-modes", "tree,budget", "--no-progress"])


def test_the_heldout_prompts_are_the_splits_first_per_category() -> None:
    from bench.training.speculators import heldout_prompts
    from draft_training.split import load_split

    one = heldout_prompts(1)
    cats = {p.category for p in load_split().prompts("heldout")}
    assert sorted(p.category for p in one) == sorted(cats)
    two = heldout_prompts(2)
    assert all(p in two for p in one) and len(two) <= 2 * len(cats) and len(heldout_prompts(0)) >= len(two)


def test_the_merged_part_runs_each_pair_through_bench_merged(tmp_path: Path) -> None:
    """--parts merged: bench.end_to_end.merged runs SSM_1 with the boosted and with the independent SSM_2 (at
    --nodes, in turn and in parallel, on the held-out prompts); the rows add boost.json's union
    top-1 (SSM_1's own for `one`) and leave out `other` (SSM_2 alone)."""
    from bench.training import speculators_merged as sm

    boost_dir = tmp_path / "boost"
    rows = [
        {"ssm": 1, "single_top1": 0.27, "union_top1": 0.27},
        {"ssm": 2, "single_top1": 0.2, "union_top1": 0.34, "indep_union_top1": 0.33},
    ]
    for folder in ("ssm2", "indep2"):
        (boost_dir / folder).mkdir(parents=True)
        (boost_dir / folder / "draft.gguf").write_bytes(b"GGUF")  # exported already: used as it is
    calls: list[list[str]] = []

    cores = os.sched_getaffinity(0)

    def fake_merged(argv: Sequence[str]) -> int:
        argv = list(argv)
        calls.append(argv)
        assert os.sched_getaffinity(0) == cores  # every pair starts with the cores the bench had
        os.sched_setaffinity(0, {min(cores)})  # as bench.end_to_end.merged pins the edge
        prompts = Path(argv[argv.index("--prompt-file") + 1]).read_text().splitlines()
        assert len(prompts) == 14  # one held-out prompt of each category of the committed split
        variants = ["ar", "one", "other", "merged", "merged_parallel"]
        out = {
            "rows": [{"variant": v, "tau_pooled": 1.0 + k, "ms_per_token": 50.0 - k, "nodes_per_round": 8 - k}
                     for k, v in enumerate(variants)],
            "identical_to_ar": {v: True for v in variants[1:]},
        }  # fmt: skip
        Path(argv[argv.index("--json") + 1]).write_text(json.dumps(out))
        return 0

    with pytest.raises(FileNotFoundError, match=r"boost\.json"):
        sm.merged_part(boost_dir, "tiny", "ssm1", "base", None, 1, 8, 16, run_merged=fake_merged)
    (boost_dir / "boost.json").write_text(json.dumps({"rows": rows}))
    got = sm.merged_part(boost_dir, "tiny", "ssm1", "base", None, 1, 8, 16, run_merged=fake_merged)
    assert [c[c.index("--draft", 4) + 1] for c in calls] == [
        str(boost_dir / "ssm2" / "draft.gguf"),
        str(boost_dir / "indep2" / "draft.gguf"),
    ]
    assert all("--parallel" in c and c[c.index("--nodes") + 1] == "8" and c[c.index("--draft") + 1] == "ssm1"
               for c in calls)  # fmt: skip
    assert [(r["pair"], r["variant"]) for r in got] == [
        (p, v) for p in ("boosted", "independent") for v in ("ar", "one", "merged", "merged_parallel")
    ]
    union = {(r["pair"], r["variant"]): r["union_top1"] for r in got}
    assert union[("boosted", "merged")] == 0.34 and union[("independent", "merged_parallel")] == 0.33
    assert union[("boosted", "one")] == 0.27 and union[("boosted", "ar")] is None
    assert os.sched_getaffinity(0) == cores
    assert got[3]["tau"] == 5.0 and got[3]["nodes_per_round"] == 4 and got[3]["identical_to_ar"] is True
    # an SSM_2 with neither a GGUF nor trained weights: a clear error, through the bench's exit 2
    (boost_dir / "indep2" / "draft.gguf").unlink()
    with pytest.raises(FileNotFoundError, match=r"draft\.safetensors"):
        sm.merged_part(boost_dir, "tiny", "ssm1", "base", None, 1, 8, 16, run_merged=fake_merged)
    with pytest.raises(SystemExit) as exc:
        main(["--parts", "merged", "--boost", str(tmp_path / "none")])
    assert exc.value.code == 2
