"""bench.end_to_end.draft_parallel on the tiny torch drafter: every variant is measured, in turn and parallel
draft the same merged trees, and bad arguments are refused before anything loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.end_to_end.draft_parallel import main


def test_in_turn_and_parallel_draft_the_same_merged_trees(tmp_path: Path) -> None:
    out = tmp_path / "dp.json"
    args = ["--draft", "tiny", "--draft", "tiny", "--drafter", "torch", "--prompts", "1", "--positions", "3"]
    assert main([*args, "--nodes", "4", "--no-progress", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert set(res["median_ms"]) == {"alone 0", "alone 1", "in_turn", "parallel"}
    assert res["rounds"] == 3 and res["identical_trees"] == 3
    assert all(ms > 0 for ms in res["median_ms"].values())


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--draft", "tiny"], "two or more --draft"),
        (
            ["--draft", "a", "--draft", "b", "--draft", "c", "--drafter", "x", "--drafter", "y"],
            "one per --draft",
        ),
        (["--draft", "a", "--draft", "b", "--nodes", "0"], "must be positive"),
    ],
)
def test_bad_arguments_are_refused(args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(args)
    assert message in capsys.readouterr().err
