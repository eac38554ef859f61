"""bench.end_to_end.e2e's per-mode summary: what the benches and the issues' tables read."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bench.end_to_end.e2e_results import ModeRuns
from edge_client.stats import GenerationResult, GenerationStats


def _gen(n: int, **stats: Any) -> GenerationResult:
    return GenerationResult(
        prompt_tokens=[1], tokens=list(range(n)), stats=GenerationStats(tokens=n, **stats)
    )


def test_round_times_pool_every_generation() -> None:
    runs = ModeRuns()
    # generation 1: 3 rounds, two drafted on the critical path (one was a pre-speculation hit)
    runs.add(
        _gen(
            9,
            rounds=3,
            draft_ms=[10.0, 20.0],
            verify_ms=[5.0, 6.0, 7.0],
            rtt_ms=[50.0, 52.0],
            prespec_ms=30.0,
            prespec_sent=2,
            prespec_cancelled=3,
            wall_s=0.9,
        ),
        forwards=3,
    )
    # generation 2: 1 round
    runs.add(_gen(4, rounds=1, draft_ms=[30.0], verify_ms=[9.0], rtt_ms=[60.0], wall_s=0.2), forwards=1)
    s = runs.summary()
    assert s["draft_ms_per_round"] == pytest.approx(60.0 / 4)  # critical-path drafting over all rounds
    assert s["verify_ms_per_round"] == pytest.approx(6.5)  # median of 5, 6, 7, 9
    assert s["rtt_ms_per_round"] == pytest.approx(52.0)  # median of 50, 52, 60
    assert s["prespec_draft_ms_per_round"] == pytest.approx(30.0 / 4)
    assert s["prespec_trees_per_round"] == pytest.approx(2 / 4)
    assert s["prespec_cancelled_per_round"] == pytest.approx(3 / 4)
    assert s["tau_pooled"] == pytest.approx(13 / 4)
    assert s["ms_per_token"] == pytest.approx((100.0 + 50.0) / 2)  # median of the per-generation figures
    assert s["target_forwards_per_token"] == pytest.approx(
        (3 / 9 + 1 / 4) / 2, abs=1e-4
    )  # rounded to 4 places


def test_empty_runs_summarise_to_zeros() -> None:
    s = ModeRuns().summary()
    assert s["draft_ms_per_round"] == 0.0 and s["rtt_ms_per_round"] == 0.0 and s["hit_rate"] is None


def test_categories_and_depths_are_pooled() -> None:
    from bench.harness import BenchPrompt

    runs = ModeRuns()
    he, sb = BenchPrompt("HumanEval/0", "humaneval", "def f():", raw=True), BenchPrompt(1, "math", "2+2?")
    runs.add(_gen(10, rounds=2, accepted_counts=[2, 2, 1]), forwards=2, prompt=he)
    runs.add(_gen(6, rounds=3, accepted_counts=[2, 1]), forwards=3, prompt=sb)
    runs.add(_gen(4, rounds=1, accepted_counts=[1]), forwards=1, prompt=he)
    s = runs.summary()
    assert s["tau_by_category"] == {"humaneval": pytest.approx(14 / 3, abs=1e-4), "math": pytest.approx(2.0)}
    assert s["acceptance_by_depth"] == pytest.approx([5 / 6, 3 / 6, 1 / 6], abs=1e-4)
    assert runs.records[0]["prompt"] == "HumanEval/0" and runs.records[1]["category"] == "math"
    # the goals are per suite: HumanEval apart from every Spec-Bench category
    suites = s["by_suite"]
    assert set(suites) == {"humaneval", "spec_bench"}
    assert suites["humaneval"]["generations"] == 2 and suites["spec_bench"]["generations"] == 1
    assert suites["humaneval"]["tau"] == pytest.approx((5.0 + 4.0) / 2)  # median of 10/2 and 4/1
    assert suites["humaneval"]["tau_pooled"] == pytest.approx(14 / 3, abs=1e-4)
    assert suites["spec_bench"]["target_forwards_per_token"] == pytest.approx(3 / 6)


def test_runs_made_in_pieces_merge_into_one_report(tmp_path: Any) -> None:
    import json

    from bench.end_to_end.e2e_results import SAME_RUN, merge_results, report
    from bench.harness import BenchPrompt

    cfg = {k: None for k in SAME_RUN} | {"mode": "greedy", "model": "m"}
    prompts = [BenchPrompt("a", "x", "p"), BenchPrompt("b", "y", "q")]

    def piece(name: str, modes: dict[str, list[list[int]]]) -> str:
        runs = {}
        for m, outs in modes.items():
            runs[m] = ModeRuns()
            for p, toks in zip(prompts, outs, strict=True):
                runs[m].add(_gen(len(toks), rounds=1), forwards=1, prompt=p)
                runs[m].records[-1]["tokens"] = toks
        doc = report(runs, {}, exact=True) | {"config": cfg}
        path = tmp_path / name
        path.write_text(json.dumps(doc))
        return str(path)

    ar = piece("ar.json", {"ar": [[1, 2], [3]]})
    spec = piece("spec.json", {"tree": [[1, 2], [3]], "sequence": [[1, 2], [3]]})
    merged = merge_results([ar, spec])
    assert set(merged["modes"]) == {"ar", "tree", "sequence"} and merged["identical_to_ar"] is True
    wrong = piece("wrong.json", {"tree": [[1, 2], [4]]})
    assert merge_results([ar, wrong])["identical_to_ar"] is False
    other = tmp_path / "other.json"
    other.write_text(json.dumps(json.loads(Path(spec).read_text()) | {"config": cfg | {"model": "n"}}))
    with pytest.raises(ValueError, match="other settings"):
        merge_results([ar, str(other)])
