"""bench.end_to_end.network's rows carry where the time goes (V, T_b, p, stall, prefill share, the server's
gap) and --trace writes every generation's rounds: hand-built stats with known answers, and one
cheap traced run of the row code against the tiny verifier."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from bench.end_to_end.e2e_results import ModeRuns
from bench.end_to_end.network import main, mode_row, run_block, trace_entry
from bench.end_to_end.network_report import (
    _identity_line,
    decomposition,
    identical_to_ar,
    report,
    write_trace,
)
from bench.harness import BenchPrompt
from edge_client.client import GenerationResult
from edge_client.stats import GenerationStats, RoundTrace, SendEvent, VerdictEvent
from shared.tree import ExpansionConfig

OLD_KEYS = (
    *("rtt_ms", "mode", "temperature", "ms_per_token", "tau", "hit_rate", "hit_rate_by_depth"),
    *("predicted_hit_rate", "target_forwards_per_token", "bytes_up_per_token", "bytes_down_per_token"),
    *("draft_ms_per_round", "verify_ms_per_round", "rtt_ms_per_round", "prespec_draft_ms_per_round"),
    *("prespec_trees_per_round", "prespec_cancelled_per_round", "prespec_refused_per_round"),
)
NEW_KEYS = (
    *("V_ms", "V_idle_ms", "V_idle_replay_ms", "idle_replay_diverged", "identical_to_ar", "T_b_ms", "p"),
    *("stall_ms_per_round", "prefill_share_ms_per_token", "decode_ms_per_token", "ttft_ms", "gap_ms"),
)


def _verdict(t: float, rnd: int, verify_ms: float, hit: bool, done: bool = False) -> VerdictEvent:
    return VerdictEvent(t, rnd, 1, 2, verify_ms, hit, rnd + 1 if hit else None, done)


def traced() -> GenerationStats:
    """Four verdicts: round 0 (150 ms after the prompt left) a hit, round 1 25 ms later (20 ms of
    verify: 5 ms of stall) a miss, round 2 after the miss (no stall counted), a hit, round 3 40 ms
    later (30 ms of verify: 10 ms of stall)."""
    tr = RoundTrace(
        sends=[SendEvent(1.0, 0, None, 4, 2, 0, 1.0, 80)],
        verdicts=[
            _verdict(1.150, 0, 100.0, hit=True),
            _verdict(1.175, 1, 20.0, hit=False),
            _verdict(1.300, 2, 20.0, hit=True),
            _verdict(1.340, 3, 30.0, hit=False, done=True),
        ],
    )
    return GenerationStats(
        rounds=4,
        tokens=10,
        verify_ms=[100.0, 20.0, 20.0, 30.0],
        idle_verify_ms=[12.0, 15.0, 11.0, 16.0],  # the curve at each tree's nodes: the edge idle
        draft_ms=[5.0, 7.0],  # the first tree (before the prompt), then the miss after round 1
        gap_ms=[0.1, 40.0, 0.2],
        trace=tr,
        hits=2,
        decided=3,
        wall_s=0.35,
    )


def untraced() -> GenerationStats:
    """Mode ar: no tree, no trace; the first verdict 50 ms after the start."""
    return GenerationStats(rounds=3, tokens=5, verify_ms=[40.0, 10.0, 10.0], first_token_s=0.05, wall_s=0.1)


def test_the_decomposition_of_hand_built_rounds() -> None:
    d = decomposition([traced()])
    assert d["V_ms"] == 20.0  # median of 20, 20, 30: round 0's prefill left out
    assert d["V_idle_ms"] == 15.0  # the same rounds with the edge idle: 15, 11, 16
    assert d["T_b_ms"] == 7.0  # the miss's draft, not the first tree's
    assert d["stall_ms_per_round"] == pytest.approx((5.0 + 10.0) / 3)  # over the 3 rounds after the first
    assert d["prefill_share_ms_per_token"] == pytest.approx(150.0 / 10)
    assert d["gap_ms"] == 0.2
    both = decomposition([traced(), untraced()])
    assert both["V_ms"] == 20.0  # 10, 10, 20, 20, 30
    assert both["prefill_share_ms_per_token"] == pytest.approx((15.0 + 50.0 / 5) / 2)
    assert both["stall_ms_per_round"] == pytest.approx(5.0)  # the untraced generation adds no rounds
    alone = decomposition([untraced()])
    assert alone["T_b_ms"] is None and alone["gap_ms"] is None and alone["stall_ms_per_round"] is None
    assert alone["V_ms"] == 10.0 and alone["prefill_share_ms_per_token"] == pytest.approx(10.0)
    assert alone["V_idle_ms"] is None  # mode ar drafts nothing: its V_ms is the edge-idle figure


def test_a_late_hit_is_stall() -> None:
    st = traced()
    assert st.trace is not None
    # the tree of round 1 reached the server 60 ms after verdict 0: 85 ms between the verdicts
    st.trace.verdicts[1] = _verdict(1.235, 1, 20.0, hit=False)
    assert decomposition([st])["stall_ms_per_round"] == pytest.approx((65.0 + 10.0) / 3)


def test_a_row_keeps_every_key_and_adds_the_decomposition() -> None:
    st = traced()
    runs = ModeRuns()
    runs.add(GenerationResult(prompt_tokens=[1, 2], tokens=list(range(10)), stats=st), forwards=4.0)
    row = mode_row("tree_prespec", 50.0, 0.0, runs, [st])
    assert set(row) == set(OLD_KEYS) | set(NEW_KEYS)
    assert row["p"] == row["hit_rate"] == pytest.approx(2 / 3, abs=1e-4)
    assert (row["V_ms"], row["T_b_ms"], row["gap_ms"]) == (20.0, 7.0, 0.2)
    plain = mode_row("tree", 50.0, 0.0, runs, [st])
    assert plain["p"] is None and plain["hit_rate"] is None  # as hit_rate: only pre-speculating modes
    entry = trace_entry("tree_prespec", 50.0, 0.0, 3, st)
    assert entry["prompt_index"] == 3 and entry["trace"]["verdicts"][1]["verify_ms"] == 20.0
    assert entry["stats"]["tokens"] == 10 and entry["stats"]["gap_ms"] == 0.2


def test_the_report_shows_where_the_time_goes() -> None:
    st = traced()
    runs = ModeRuns()
    runs.add(GenerationResult(prompt_tokens=[1, 2], tokens=list(range(10)), stats=st), forwards=4.0)
    rows = [mode_row("tree_prespec", 50.0, 0.0, runs, [st])]
    result = report(rows, {"model": "m"})
    assert result.status == 0 and result.config == {"model": "m"}
    text = result.table
    table = text[text.index("where the time goes") :]
    header, _, line = table.splitlines()[1:4]
    assert (
        "stall ms/rnd" in header
        and "gap ms" in header
        and "V idle ms" in header
        and "V idle replay" in header
    )
    cells = line.split()[-10:]  # V, V idle, V idle replay, T_b, p, stall, prefill, decode, TTFT, gap
    assert cells[2] == "-"  # no idle replay in this run
    assert [float(x) for x in cells[:2] + cells[3:7] + cells[9:]] == [20.0, 15.0, 7.0, 0.667, 5.0, 15.0, 0.2]
    row = rows[0]
    assert float(cells[7]) == pytest.approx(row["ms_per_token"] - 15.0, abs=1e-3)  # decode: after the prefill
    ttft = row["ttft_ms"]  # None: these hand-built stats record no first-token time
    assert cells[8] == "-" if ttft is None else float(cells[8]) == pytest.approx(ttft, abs=1e-3)
    assert result.rows[0]["stall_ms_per_round"] == 5.0


def test_help_explains_every_new_flag_and_key(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--trace PATH" in text and "bench.simulation.simulate" in text
    for key in NEW_KEYS:
        assert key in text
    assert "--max-pending" in text and "default: the verifier's own" in text


def test_a_traced_block_on_the_tiny_pair(tmp_path: Path) -> None:
    """The row and trace code on a real run: the tiny verifier in this process, the same weights
    drafting with torch; one short prompt in ar, tree and tree + pre-speculation, then the tree
    modes' idle replay."""
    from bench.simulation.simulate import load_generations
    from edge_client.drafters.registry import create_drafter
    from tests.cloud_verifier.service import LiveServer

    drafter = create_drafter("torch", "tiny", n_threads=1)
    prompts = [BenchPrompt("q0", "writing", "Write a short poem about the sea.")]
    try:
        with LiveServer(measure_cost=True) as srv:  # a cost curve: the edge-idle verify time
            rows, entries = asyncio.run(
                run_block(
                    srv.ws,
                    drafter,
                    prompts,
                    8,
                    0.0,
                    0.0,
                    ExpansionConfig.parse("2,1,1"),
                    lambda: 0.0,
                    ["ar", "tree", "tree_prespec"],
                    progress=False,
                    idle_replay=True,
                )
            )
    finally:
        drafter.close()
    by_mode = {r["mode"]: r for r in rows}
    assert set(by_mode) == {"ar", "tree", "tree_prespec"}
    for r in rows:
        assert set(r) == set(OLD_KEYS) | set(NEW_KEYS)
        assert r["V_ms"] is not None and r["V_ms"] > 0
        assert r["prefill_share_ms_per_token"] is not None and r["prefill_share_ms_per_token"] > 0
        assert r["p"] == r["hit_rate"]
        assert r["stall_ms_per_round"] is not None
    # the verifier sent its gap for every tree round (the edge asks for it in its hello)
    for m in ("tree", "tree_prespec"):
        assert by_mode[m]["gap_ms"] is not None and by_mode[m]["gap_ms"] >= 0
    assert by_mode["ar"]["gap_ms"] is None and by_mode["ar"]["T_b_ms"] is None  # no tree, no draft
    assert by_mode["ar"]["V_idle_ms"] is None
    for m in ("tree", "tree_prespec"):
        assert by_mode[m]["V_idle_ms"] is not None and by_mode[m]["V_idle_ms"] > 0
    assert by_mode["tree"]["T_b_ms"] is not None and by_mode["tree"]["T_b_ms"] > 0  # every round misses
    # the idle replay: every tree mode's rounds verified again with nothing drafting, verdict for verdict
    assert by_mode["ar"]["V_idle_replay_ms"] is None and by_mode["ar"]["idle_replay_diverged"] is None
    for m in ("tree", "tree_prespec"):
        assert by_mode[m]["V_idle_replay_ms"] is not None and by_mode[m]["V_idle_replay_ms"] > 0
        assert by_mode[m]["idle_replay_diverged"] == 0
    # greedy: every mode's tokens are ar's
    assert identical_to_ar(entries) == {("tree", 0.0, 0.0): True, ("tree_prespec", 0.0, 0.0): True}
    # one trace entry per generation, and bench.simulation.simulate reads the file
    assert sorted(e["mode"] for e in entries) == ["ar", "tree", "tree_prespec"]
    for e in entries:
        assert e["trace"] is not None and e["trace"]["verdicts"] and e["stats"]["tokens"] > 0
    path = tmp_path / "trace.json"
    write_trace(str(path), {"model": "tiny"}, entries)
    doc = json.loads(path.read_text())
    assert doc["config"] == {"model": "tiny"} and len(doc["generations"]) == 3
    spec, ar = load_generations([path])
    assert len(spec) == 2 and len(ar) == 1


def test_saguaro_c_reaches_every_pre_speculating_variant(capsys: pytest.CaptureFixture[str]) -> None:
    from bench.end_to_end.e2e import variants
    from edge_client.client import PrespecConfig

    tree = ExpansionConfig.parse("2,1,1")
    vs = variants(["tree", "tree_prespec", "tree_prespec_chain", "budget_prespec"], tree, 0.5)
    assert vs["tree"].prespec is False
    for m in ("tree_prespec", "tree_prespec_chain", "budget_prespec"):
        cfg = vs[m].prespec
        assert isinstance(cfg, PrespecConfig) and cfg.saguaro_c == 0.5
    chain = vs["tree_prespec_chain"].prespec
    assert isinstance(chain, PrespecConfig) and chain.backup == "chain"  # the variant's own settings kept
    assert variants(["tree_prespec"], tree)["tree_prespec"].prespec is True  # C = 1: untouched
    with pytest.raises(SystemExit):
        main(["--saguaro-c", "0"])
    assert "--saguaro-c must be in (0, 1]" in capsys.readouterr().err


def test_mss_and_rrs_modes_verify_their_own_way() -> None:
    """tree_mss / tree_prespec_mss (children with replacement) and the rrs modes carry their own
    verification mode; any of them in --modes gives the verifier a trusted key file."""
    from bench.end_to_end.e2e import STOCHASTIC_MODES, variants
    from bench.end_to_end.network import verifier_args
    from shared.messages import Mode

    expected = {"tree_mss", "tree_prespec_mss", "tree_rrs", "tree_prespec_rrs", "tree_prespec_rrs_single"}
    assert set(STOCHASTIC_MODES) == expected
    vs = variants(sorted(expected | {"tree_prespec"}), ExpansionConfig.parse("2,1,1"), 0.5)
    assert vs["tree_mss"].mode is Mode.MSS and vs["tree_prespec_mss"].mode is Mode.MSS
    assert vs["tree_rrs"].mode is Mode.RRS and vs["tree_prespec"].mode is None
    assert vs["tree_mss"].prespec is False
    prespec = vs["tree_prespec_mss"].prespec
    assert not isinstance(prespec, bool) and prespec.saguaro_c == 0.5  # C reaches mss too
    for m in ("tree_mss", "tree_prespec_rrs"):
        args, key = verifier_args(None, ["ar", m])
        key_file = Path(args[args.index("--api-key-file") + 1])
        assert key and key_file.read_text() == f"{key} trusted\n"
        key_file.unlink()
    args, key = verifier_args(None, ["ar", "tree_prespec"])
    assert key is None and "--api-key-file" not in args


def test_identity_with_ar_is_checked_prompt_by_prompt_at_any_rtt() -> None:
    def e(mode: str, rtt: float, t: float, i: int, tokens: list[int] | None) -> dict[str, object]:
        return {"mode": mode, "rtt_ms": rtt, "temperature": t, "prompt_index": i, "tokens": tokens}

    entries = [
        *(e("ar", 0.0, 0.0, i, [i, 7]) for i in (0, 1)),
        *(e("tree", 0.0, 0.0, i, [i, 7]) for i in (0, 1)),
        e("tree_prespec", 25.0, 0.0, 0, [0, 7]),  # ar ran at another RTT: still compared
        e("tree_prespec", 25.0, 0.0, 1, [1, 8]),  # one token differs
        e("tree_mss", 0.0, 0.0, 0, [5]),  # skipped: its promise is the distribution
        e("tree", 0.0, 0.7, 0, [0, 7]),  # no ar at T 0.7
        e("budget", 0.0, 0.0, 0, None),  # an older trace without tokens
    ]
    same = identical_to_ar(entries, skip=("tree_mss",))
    assert same == {
        ("tree", 0.0, 0.0): True,
        ("tree_prespec", 25.0, 0.0): False,
        ("tree_mss", 0.0, 0.0): None,
        ("tree", 0.0, 0.7): None,
        ("budget", 0.0, 0.0): None,
    }
    rows = [
        {"mode": m, "rtt_ms": rtt, "temperature": t, "identical_to_ar": v} for (m, rtt, t), v in same.items()
    ]
    line = _identity_line(rows)
    assert line == "NOT identical to ar's tokens: tree_prespec (rtt 25, T 0)"
    assert _identity_line(rows[:1]) == "identical to ar's tokens, prompt for prompt: all 1 rows checked"
    assert _identity_line(rows[2:]) is None
