"""bench.end_to_end.prefill_share end to end on the tiny model: the honest tokens never change beside a long
prefill."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.end_to_end import prefill_share


def test_prefill_share_runs_and_reports_each_chunk(tmp_path: Path) -> None:
    out = tmp_path / "p.json"
    rc = prefill_share.main(
        ["--model", "tiny", "--prefill", "200", "--tokens", "6", "--repeats", "1", "--chunks", "16",
         "--core", "-1", "--no-progress", "--json", str(out)]
    )  # fmt: skip
    assert rc == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["prefill_chunk"] for r in rows] == [16]
    assert all(r["identical"] and r["alone_s"] > 0 and r["beside_prefill_s"] > 0 for r in rows)


def test_prefill_share_refuses_bad_chunks() -> None:
    with pytest.raises(SystemExit):
        prefill_share.main(["--chunks", "0"])
