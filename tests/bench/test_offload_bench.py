"""bench.kernels.offload: the forward part on a tiny random model (each budget in its own process) writes
the rows the issue names; the modes part's rows and table from a verifier's block; bad arguments
exit 2 with the reason."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.kernels import offload as bench_offload

ROOT = Path(__file__).resolve().parents[2]


def test_the_forward_part_streams_what_the_budget_leaves_out(tmp_path: Path) -> None:
    out = tmp_path / "off.json"
    png = tmp_path / "off.png"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.kernels.offload",
            "--shape",
            "tiny",
            "--parts",
            "forward",
            "--resident",
            "1,0",
            "--rows",
            "1,4",
            "--repeats",
            "1",
            "--json",
            str(out),
            "--plot",
            str(png),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["complete"] is True and doc["layer_bytes"] > 0
    full, none = doc["rows"]
    assert full["part"] == none["part"] == "forward"
    assert (full["resident_fraction"], none["resident_fraction"]) == (1.0, 0.0)
    # everything resident reads nothing; nothing resident reads every layer each forward
    assert full["layers_resident"] == full["layers"] and full["bytes_per_forward"] == 0
    assert none["layers_resident"] == 0 and none["bytes_per_forward"] >= doc["layer_bytes"]
    assert set(none["rows_ms"]) == {"1", "4"} and all(v > 0 for v in none["rows_ms"].values())
    assert 0 <= none["overlap_1row"] <= 1 and none["peak_rss_gb"] > 0
    assert png.is_file() and png.stat().st_size > 1000
    assert "overlap@1" in r.stdout
    assert full["held_gb"] > 0 and none["held_gb"] > 0  # the buffers, at least
    # --merge: a budget measured again replaces the first run's rows of that budget
    again = json.loads(out.read_text())
    again["rows"] = [dict(none, rows_ms={"1": 1.0, "4": 2.0})]
    second = tmp_path / "again.json"
    second.write_text(json.dumps(again))
    merged, mpng = tmp_path / "merged.json", tmp_path / "merged.png"
    assert bench_offload.main(["--merge", f"{out},{second}", "--json", str(merged), "--plot", str(mpng)]) == 0
    doc = json.loads(merged.read_text())
    assert [r["resident_fraction"] for r in doc["rows"]] == [1.0, 0.0]
    assert doc["rows"][1]["rows_ms"] == {"1": 1.0, "4": 2.0} and doc["rows"][0] == full
    assert doc["config"]["merged_from"] == [str(out), str(second)] and mpng.is_file()
    again["config"]["model"] = "another-model"
    second.write_text(json.dumps(again))
    with pytest.raises(SystemExit):
        bench_offload.main(["--merge", f"{out},{second}"])


def test_modes_rows_carry_the_speedup_over_ar_and_bytes_per_token() -> None:
    block = [
        {"mode": "ar", "ms_per_token": 900.0, "tau": 1.0, "target_forwards_per_token": 1.0},
        {"mode": "tree", "ms_per_token": 300.0, "tau": 4.0, "target_forwards_per_token": 0.25},
    ]
    rows = bench_offload.mode_rows(block, 0.25, (0.5, 0.1), {0.25: 800_000_000}, 1.2)
    ar, tree = rows
    assert tree["speedup_vs_ar"] == 3.0 and tree["ratio_to_ar"] == pytest.approx(1 / 3, abs=1e-3)
    assert tree["bytes_read_per_token"] == 200_000_000 and ar["bytes_read_per_token"] == 800_000_000
    assert tree["peak_rss_gb"] == 1.2 and (tree["budget_gb"], tree["kv_pool_gb"]) == (0.5, 0.1)
    assert {"resident_fraction", "mode", "ms_per_token", "tau", "peak_rss_gb"} <= set(tree)


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--resident", "1.5"], "fractions in [0, 1]"),
        (["--shape", "tiny"], "--parts forward"),
        (["--parts", "nothing"], "--parts"),
        (["--repeats", "0", "--parts", "forward"], "--repeats"),
    ],
)
def test_bad_arguments_exit_2(argv: list[str], says: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        bench_offload.main(argv)
    assert exc.value.code == 2
    assert says in capsys.readouterr().err


def test_budgets_take_the_kv_pool_out_and_keep_every_layer_at_one() -> None:
    """Below 1 the verifier's --resident-gb is the fraction of the layers and its KV pool comes out
    of it; at 1 the budget is raised by the pool (which grows with the budget) so no layer streams."""
    import argparse

    from cloud_verifier.kv_pool import kv_reserve_bytes
    from cloud_verifier.server_config import ServerConfig
    from shared.model.target import streamed_config

    args = argparse.Namespace(
        shape=None, model="tiny", weights="fp32", offload="disk", device="cpu", resident=[1.0, 0.25]
    )
    layers = 1_122_304
    plan = bench_offload.budgets(args, layers)
    c = streamed_config("tiny")
    for budget, pool in plan.values():
        cfg = ServerConfig(model="tiny", weights="fp32", offload="disk", device="cpu", resident_gb=budget)
        assert pool == kv_reserve_bytes(cfg, c) / 1e9 > 0
    assert plan[0.25][0] == 0.25 * layers / 1e9
    budget, pool = plan[1.0]
    assert budget - pool >= layers / 1e9 - 1e-9 and budget > layers / 1e9
