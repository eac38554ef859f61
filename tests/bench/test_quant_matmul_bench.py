"""`python -m bench.kernels.quant_matmul` on a small GGUF written here (Q8_0 and Q5_0 matrices, which gguf-py
can quantize): the table's rows and the result file's shape."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize

from bench.kernels import quant_matmul as bench
from treespec_kernels import quant_matmul as qm

pytestmark = pytest.mark.skipif(qm.load() is None, reason=f"quant_matmul kernel not built: {qm.error()}")


def write_gguf(path: Path) -> None:
    rng = np.random.default_rng(0)
    w = GGUFWriter(str(path), "llama")
    for name, qtype, shape in (
        ("blk.0.attn_q.weight", GGMLQuantizationType.Q8_0, (64, 128)),
        ("blk.0.ffn_up.weight", GGMLQuantizationType.Q5_0, (96, 64)),
        ("blk.0.attn_norm.weight", GGMLQuantizationType.F32, (64,)),
        ("blk.1.attn_q.weight", GGMLQuantizationType.Q8_0, (64, 128)),  # a later layer: left out
    ):
        data = rng.standard_normal(shape).astype(np.float32)
        if qtype == GGMLQuantizationType.F32:
            w.add_tensor(name, data)
        else:
            w.add_tensor(name, quantize(data, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_the_bench_times_each_matrix_of_layer_zero(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = tmp_path / "small.gguf"
    write_gguf(model)
    out = tmp_path / "r.json"
    argv = ["--model", str(model), "--rows", "1,4", "--threads", "1", "--repeats", "1", "--no-progress"]
    assert bench.main([*argv, "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["complete"] is True and result["config"]["rows"] == [1, 4]
    got = {(r["matrix"], r["type"], r["out"], r["in"], r["rows"]) for r in result["rows"]}
    assert got == {
        ("blk.0.attn_q.weight", "Q8_0", 64, 128, 1),
        ("blk.0.attn_q.weight", "Q8_0", 64, 128, 4),
        ("blk.0.ffn_up.weight", "Q5_0", 96, 64, 1),
        ("blk.0.ffn_up.weight", "Q5_0", 96, 64, 4),
    }
    row = result["rows"][0]
    assert row["quant_ms"] > 0 and row["fp32_ms"] > 0 and row["quant_bytes"] < row["fp32_bytes"]
    assert "4 rows / 1 row" in capsys.readouterr().out


def test_bad_flags_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        bench.main(["--rows", "0"])
    assert "positive integers" in capsys.readouterr().err


def test_the_memory_bench_reports_the_process_and_the_pool(tmp_path: Path) -> None:
    from bench.serving import verifier_memory

    out = tmp_path / "m.json"
    argv = ["--model", "tiny", "--weights", "fp32", "--prefill", "8", "--steps", "1", "--threads", "1"]
    assert verifier_memory.main([*argv, "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["weights"] == "fp32" and row["kv_blocks"] >= 8 and row["kv_pool_mib"] > 0
    assert 0 < row["rss_mib"] <= row["peak_rss_mib"] + 1  # (two clocks: pages counted a moment apart)
