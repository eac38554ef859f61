"""bench.serving.load end to end on the tiny model: the real service on loopback, batched and unbatched,
and the documented JSON."""

from __future__ import annotations

import json
from pathlib import Path

from bench.lib.stats import percentile
from bench.serving import load, load_figures
from cloud_verifier.server_config import ServerConfig
from tests.cloud_verifier.service import tiny

RUN_KEYS = {
    "clients",
    "batching",
    "sessions_completed",
    "errors",
    "tokens_per_s",
    "round_ms_p50",
    "round_ms_p99",
}


def test_two_clients_batched_and_unbatched_write_the_documented_json(tmp_path: Path) -> None:
    out = tmp_path / "load.json"
    argv = ["--clients", "2", "--seconds", "2", "--model", "tiny", "--warmup", "0", "--tokens", "16"]
    assert load.main([*argv, "--max-prompt-tokens", "200", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert {"runs", "batching_speedup"} <= set(data)
    runs = data["runs"]
    assert [(r["clients"], r["batching"]) for r in runs] == [(2, True), (2, False)]
    for r in runs:
        assert RUN_KEYS <= set(r), r
        assert r["errors"] == 0, r.get("error_samples")
        assert r["sessions_completed"] > 0 and r["tokens_per_s"] > 0
        assert 0 < r["round_ms_p50"] <= r["round_ms_p99"]
    assert set(data["batching_speedup"]) == {"2"} and data["batching_speedup"]["2"] > 0


def test_url_drives_an_external_verifier_without_an_unbatched_run(tmp_path: Path) -> None:
    out = tmp_path / "load.json"
    config = ServerConfig(model="tiny", measure_cost=False, max_sessions=4, max_context=1024)
    with load.InProcessServer(config, tiny()) as srv:
        argv = ["--url", srv.url, "--clients", "1", "--seconds", "1", "--warmup", "0", "--tokens", "8"]
        assert load.main([*argv, "--max-prompt-tokens", "200", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert [(r["clients"], r["batching"]) for r in data["runs"]] == [(1, None)]
    assert data["runs"][0]["errors"] == 0 and data["runs"][0]["tokens_per_s"] > 0
    assert data["batching_speedup"] == {}


def test_percentile_is_nearest_rank_and_speedup_pairs_runs() -> None:
    values = [float(x) for x in range(1, 101)]
    assert percentile(values, 50) == 50.0 and percentile(values, 99) == 99.0
    assert percentile([7.0], 99) == 7.0 and percentile([], 50) is None
    runs = [
        {"clients": 4, "batching": True, "tokens_per_s": 30.0},
        {"clients": 4, "batching": False, "tokens_per_s": 10.0},
        {"clients": 1, "batching": True, "tokens_per_s": 5.0},
    ]
    assert load_figures.speedups(runs) == {"4": 3.0}


def test_every_flag_has_help() -> None:
    for action in load.build_parser()._actions:
        assert action.help and len(action.help) > 10, action.dest
