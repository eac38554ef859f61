"""bench.kernels.tree_attention on the CPU (Triton's interpreter) at tiny sizes: the arguments and the
JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("triton")

from bench.kernels import tree_attention as bench

TINY = ["--device", "cpu", "--dtype", "fp32", "--heads", "4", "--kv-heads", "2", "--head-dim", "64"]


def test_tiny_run_writes_the_table_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "ta.json"
    args = [*TINY, "--sessions", "1,2", "--nodes", "3", "--prefix", "0,9", "--repeats", "1", "--warmup", "0"]
    assert bench.main([*args, "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["sessions"], r["nodes"], r["prefix"]) for r in rows] == [
        (1, 3, 0),
        (1, 3, 9),
        (2, 3, 0),
        (2, 3, 9),
    ]
    for r in rows:
        assert r["dtype"] == "fp32"
        assert r["triton_ms"] > 0 and r["sdpa_ms"] > 0 and r["reference_ms"] > 0
        assert r["speedup_vs_sdpa"] == pytest.approx(r["sdpa_ms"] / r["triton_ms"], rel=1e-2, abs=1e-3)
        assert r["max_abs_diff_vs_sdpa"] < 1e-4  # the kernel and SDPA computed the same attention
    assert "triton ms" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--nodes", "65"], "--nodes must be in 1..64"),
        (["--heads", "5"], "multiple of --kv-heads"),
        (["--head-dim", "48"], "--head-dim"),
        (["--prefix", "5000"], "interpreter"),
        (["--sessions", "1,x"], "comma-separated integers"),
    ],
)
def test_bad_arguments_exit_with_a_message(
    extra: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        bench.main([*TINY, *extra])
    assert message in capsys.readouterr().err


def test_cuda_without_cuda_says_what_to_do(capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is available")
    with pytest.raises(SystemExit):
        bench.main(["--device", "cuda"])
    assert "use --device cpu" in capsys.readouterr().err
