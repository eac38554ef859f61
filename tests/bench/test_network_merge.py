"""bench.end_to_end.network --merge: one table from runs made in pieces, refused when the pieces do not
match."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench.end_to_end.network import main
from bench.end_to_end.network_report import goal_lines, merge, prespec_base

CONFIG = {"draft": "d", "model": "m", "prompts": 2, "tokens": 8, "tree": "1,1", "proxy": True}


def _row(rtt: float, mode: str, t: float, ms: float) -> dict[str, Any]:
    return {
        "rtt_ms": rtt,
        "mode": mode,
        "temperature": t,
        "ms_per_token": ms,
        "tau": 2.0,
        "hit_rate": 0.5 if "prespec" in mode else None,
        "target_forwards_per_token": 0.5,
        "bytes_up_per_token": 10.0,
        "bytes_down_per_token": 5.0,
        "draft_ms_per_round": 1.0,
        "verify_ms_per_round": 2.0,
        "rtt_ms_per_round": rtt,
    }


def _file(tmp: Path, name: str, rows: list[dict[str, Any]], **cfg: Any) -> str:
    p = tmp / name
    p.write_text(json.dumps({"rows": rows, "complete": True, "config": {**CONFIG, **cfg}}))
    return str(p)


def test_later_files_replace_rows_and_the_rest_are_kept(tmp_path: Path) -> None:
    a = _file(tmp_path, "a.json", [_row(0, "tree", 0, 10.0), _row(0, "tree_prespec", 0, 9.0)])
    b = _file(tmp_path, "b.json", [_row(50, "tree", 0, 20.0), _row(0, "tree", 0, 11.0)])
    rows, config = merge([a, b])
    got = {(r["rtt_ms"], r["mode"]): r["ms_per_token"] for r in rows}
    assert got == {(0, "tree"): 11.0, (0, "tree_prespec"): 9.0, (50, "tree"): 20.0}
    assert [(r["rtt_ms"], r["mode"]) for r in rows] == [(0, "tree"), (0, "tree_prespec"), (50, "tree")]
    assert config["rtt_ms"] == "0,50" and config["merged_from"] == [a, b] and config["draft"] == "d"

    out = tmp_path / "merged.json"
    assert main(["--merge", f"{a},{b}", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["complete"] and len(doc["rows"]) == 3
    # a merged file merges again: its config names the same setup
    assert len(merge([str(out), a])[0]) == 3


def test_files_of_other_setups_or_shapes_are_refused(tmp_path: Path) -> None:
    a = _file(tmp_path, "a.json", [_row(0, "tree", 0, 10.0)])
    other = _file(tmp_path, "other.json", [_row(50, "tree", 0, 20.0)], draft="bigger")
    with pytest.raises(ValueError, match="draft 'bigger' vs 'd'"):
        merge([a, other])
    broken = _file(tmp_path, "broken.json", [{"rtt_ms": 0, "mode": "tree"}])
    with pytest.raises(ValueError, match="row 0 lacks"):
        merge([a, broken])
    (tmp_path / "junk.json").write_text("not json")
    with pytest.raises(ValueError, match="cannot read"):
        merge([str(tmp_path / "junk.json")])
    with pytest.raises(SystemExit):  # argparse's error: the message names --merge
        main(["--merge", f"{a},{other}"])


def test_unknown_modes_are_refused_before_anything_starts() -> None:
    with pytest.raises(SystemExit):
        main(["--modes", "tree,warp_speed"])


def test_each_prespec_mode_is_set_against_its_own_tree_and_ar() -> None:
    assert [prespec_base(m) for m in ("tree_prespec", "budget_prespec", "tree_prespec_mss", "tree")] == [
        "tree",
        "budget",
        "tree_mss",
        None,
    ]
    assert prespec_base("tree_prespec_cache") == "tree"
    rows = [
        _row(50, "ar", 0, 100.0),
        _row(0, "budget", 0, 50.0),
        _row(0, "budget_prespec", 0, 55.0),
        _row(50, "budget", 0, 40.0),
        _row(50, "budget_prespec", 0, 30.0),
        _row(50, "tree_prespec_mss", 0.7, 30.0),  # no tree_mss row and no ar at 0.7: nothing to say
    ]
    assert goal_lines(rows) == [
        "T=0: budget_prespec/budget RTT 0: 1.100, RTT 50: 0.750; slower at RTT 0",
        "T=0: at RTT 50 budget_prespec/ar = 0.300 (goal <= 0.35: met)",
    ]
    rows[4] = _row(50, "budget_prespec", 0, 36.0)
    assert goal_lines(rows)[1] == "T=0: at RTT 50 budget_prespec/ar = 0.360 (goal <= 0.35: not met)"
