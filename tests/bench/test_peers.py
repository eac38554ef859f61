"""bench.end_to_end.peers: the rows its table and JSON are made of (speed-ups against each system's own plain
decoding, tokens per target forward, output identity), and the agreement summary."""

from __future__ import annotations

import pytest

from bench.end_to_end.peers import _spec_text
from bench.end_to_end.peers_report import PLAIN, Runs, rows_of
from bench.exactness.agreement import summarise


def test_rows_compare_each_system_with_its_own_plain_decoding() -> None:
    hf_plain, hf_assist = Runs("hf-transformers", "generate"), Runs("hf-transformers", "assisted")
    ours_ar, ours_tree = Runs("treespec", "ar"), Runs("treespec", "tree")
    for p in range(3):
        hf_plain.add(0.64, 64, 65, [p, 1, 2])
        hf_assist.add(0.80, 64, 20, [p, 1, 2])
        ours_ar.add(0.64, 64, 64, [p, 5])
        ours_tree.add(0.16, 64, 12, [p, 5] if p else [p, 6])
    rows = {(r["system"], r["mode"]): r for r in rows_of([hf_plain, hf_assist, ours_ar, ours_tree], PLAIN)}
    assert rows[("hf-transformers", "assisted")]["speedup_vs_own_ar"] == pytest.approx(0.8)
    assert rows[("hf-transformers", "assisted")]["tokens_per_target_forward"] == pytest.approx(3.2)
    assert rows[("hf-transformers", "assisted")]["identical"] is True
    assert rows[("treespec", "tree")]["speedup_vs_own_ar"] == pytest.approx(4.0)
    assert rows[("treespec", "tree")]["identical"] is False  # one prompt differs
    assert rows[("treespec", "ar")]["speedup_vs_own_ar"] == pytest.approx(1.0)


def test_speculative_text_drops_the_echoed_prompt() -> None:
    assert _spec_text("  def f():\n    return 1\n", "def f():") == "return 1"
    assert _spec_text("something else", "def f():") == "something else"


def test_agreement_shares_per_category_and_overall() -> None:
    out = summarise({"code": [0, 0, 1, 7], "math": [0, 2]})
    assert out["code"]["top1"] == pytest.approx(0.5) and out["code"]["top2"] == pytest.approx(0.75)
    assert out["code"]["top5"] == pytest.approx(0.75) and out["math"]["top3"] == pytest.approx(1.0)
    assert out["all"]["top1"] == pytest.approx(3 / 6) and out["all"]["positions"] == 6


def test_llama_cpp_texts_match_when_one_extends_the_other() -> None:
    from bench.end_to_end.peers_report import _same

    assert _same(["abc def", "x"], ["abc", "x"]) and not _same(["abd"], ["abc"])
    assert _same([[1, 2]], [[1, 2]]) and not _same([[1, 2]], [[1]])


def test_identical_prompts_are_counted_and_the_end_marker_is_not_output() -> None:
    from bench.end_to_end.peers import _completion_text
    from bench.end_to_end.peers_report import _same_count

    assert _same_count(["abc def", "x", "y"], ["abc", "z", "y"]) == 2
    assert _same_count([[1, 2], [3]], [[1, 2], [4]]) == 1
    assert _completion_text("  4. Art [end of text]\n") == "4. Art"
    assert _completion_text("return x\n") == "return x"
