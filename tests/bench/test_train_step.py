"""bench.training.train_step on `tiny`: both variants timed, rows as the table says, bad sizes refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.training.train_step import main


def test_train_step_times_both_variants(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "r.json"
    assert main(["--draft", "tiny", "--steps", "2", "--seq", "24", "--positions", "8", "--no-progress",
                 "--json", str(out)]) == 0  # fmt: skip
    doc = json.loads(out.read_text())
    rows = {r["variant"]: r for r in doc["rows"]}
    assert set(rows) == {"none", "bf16"} and doc["complete"] and rows["none"]["speedup"] == 1.0
    assert all(len(r["ms_each"]) == 2 and r["ms_per_step"] > 0 for r in rows.values())
    assert "bf16" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--draft", "tiny", "--positions", "0"])
