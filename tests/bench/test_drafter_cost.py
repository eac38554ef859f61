"""bench.kernels.drafter_cost on the tiny torch drafter (the verifier phase skipped): the rows, the curve
files bench.simulation.simulate reads, and bad flags."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.kernels import drafter_cost
from bench.simulation.simulate import Curve


def test_the_curve_of_a_tiny_drafter_is_written_for_the_simulator(tmp_path: Path) -> None:
    out = tmp_path / "dc.json"
    argv = ["--draft", "tiny", "--backends", "torch", "--rows", "4,1,2", "--repeats", "2", "--no-busy"]
    assert drafter_cost.main([*argv, "--json", str(out), "--no-progress"]) == 0
    doc = json.loads(out.read_text())
    rows = doc["rows"]
    assert [r["rows"] for r in rows] == [1, 2, 4] and all(r["backend"] == "torch" for r in rows)
    assert all(r["idle_ms"] > 0 and r["busy_ms"] is None for r in rows)
    assert doc["verifier_forwards_per_s"] is None
    curve = Curve.load(tmp_path / "dc_torch_idle.json")
    assert curve(2) == pytest.approx(rows[1]["idle_ms"])
    assert not (tmp_path / "dc_torch_busy.json").exists()


def test_unknown_backends_and_rows_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        drafter_cost.main(["--backends", "onnx", "--no-busy"])
    assert "onnx_int8" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        drafter_cost.main(["--rows", "0,2"])
    assert "positive integers" in capsys.readouterr().err
