"""bench.kernels.target_step runs end to end on the tiny model and writes the documented JSON."""

from __future__ import annotations

import json
from pathlib import Path

from bench.kernels import target_step


def test_quick_run_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "t.json"
    argv = ["--model", "tiny", "--no-transformers", "--repeats", "1", "--prefixes", "16,40"]
    assert target_step.main([*argv, "--rows", "1,3", "--decode-tokens", "4", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert set(data["forward_ms"]) == {"16", "40"}
    assert set(data["forward_ms"]["40"]) == {"1", "3"} and data["forward_ms"]["40"]["3"] > 0
    assert data["decode_tok_s"]["ours"] > 0 and data["decode_tok_s"]["transformers"] is None
    assert data["ratio_vs_transformers"] is None


def test_every_flag_has_help() -> None:
    for action in target_step.build_parser()._actions:
        assert action.help, action.dest


def test_paired_ratio_is_reported_when_n1_and_n16_are_measured(tmp_path: Path) -> None:
    out = tmp_path / "t.json"
    argv = ["--model", "tiny", "--no-transformers", "--repeats", "3", "--prefixes", "16"]
    assert target_step.main([*argv, "--rows", "1,16", "--decode-tokens", "2", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert set(data["ratio_16_1_paired"]) == {"16"} and data["ratio_16_1_paired"]["16"] > 0
    assert data["attention_kernel"] in ("cpu-invariant", "sdpa")
    out2 = tmp_path / "u.json"
    assert target_step.main([*argv, "--rows", "1,3", "--decode-tokens", "2", "--json", str(out2)]) == 0
    assert json.loads(out2.read_text())["ratio_16_1_paired"] == {}
