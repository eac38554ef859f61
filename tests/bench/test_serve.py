"""bench.serving.serve: vLLM's serving metrics as pure functions on made-up timestamps, the seeded arrival
schedule, the long-prompt builder, the spec-decode counters, the exactness check, the flags, and
short runs against the tiny model (ar alone; ar and edge kinds on the same arrivals)."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np
import pytest

from bench.serving import serve
from bench.serving.serve_metrics import (
    RequestResult,
    SpecDecode,
    arrival_times,
    build_long_prompts,
    identical_outputs,
    meets,
    prompt_targets,
    spec_decode_figures,
    stats_ms,
    summarize,
    timing,
)


# ------------------------------------------------------------------------------- metrics
def test_timing_is_ttft_gaps_and_e2el_from_the_send() -> None:
    ttft, itl, e2el = timing(10.0, [10.5, 10.7, 11.0, 11.6], 12.0)
    assert ttft == pytest.approx(0.5) and e2el == pytest.approx(2.0)
    assert itl == pytest.approx([0.2, 0.3, 0.6])
    assert timing(1.0, [], 3.0) == (2.0, [], 2.0)  # no text: TTFT is the whole latency


def test_tpot_is_the_time_after_the_first_token_per_later_token() -> None:
    r = RequestResult(True, 10, output_tokens=5, ttft=0.5, latency=2.5)
    assert r.tpot == pytest.approx(0.5)  # (2.5 - 0.5) / 4
    assert RequestResult(True, 10, output_tokens=1, ttft=0.5, latency=0.5).tpot is None


def test_percentiles_and_mean_in_ms() -> None:
    s = stats_ms([0.001 * v for v in range(1, 101)])  # 1..100 ms
    assert s["mean"] == pytest.approx(50.5)
    assert s["p50"] == pytest.approx(50.5) and s["p90"] == pytest.approx(90.1)
    assert s["p99"] == pytest.approx(99.01)
    assert all(math.isnan(v) for v in stats_ms([]).values())


def _results() -> list[RequestResult]:
    return [
        RequestResult(True, 100, 11, ttft=0.2, latency=1.2, itl=[0.1] * 10),  # tpot 0.1
        RequestResult(True, 200, 5, ttft=1.5, latency=2.3, itl=[0.2] * 4),  # tpot 0.2
        RequestResult(True, 50, 1, ttft=0.3, latency=0.3),  # one token: tpot none (0 for goodput)
        RequestResult(False, 70, error="HTTP 400: too long"),
        RequestResult(False, 70, error="HTTP 400: too long"),
    ]


def test_a_runs_figures_count_completed_requests_only() -> None:
    row = summarize(_results(), duration=2.0, slos_ms={"ttft": 1000, "tpot": 150})
    assert (row["completed"], row["failed"], row["errors"]) == (3, 2, ["HTTP 400: too long"])
    assert (row["total_input_tokens"], row["total_output_tokens"]) == (350, 17)
    assert row["request_throughput"] == pytest.approx(1.5)
    assert row["output_throughput"] == pytest.approx(8.5)
    # the first and the one-token request meet ttft <= 1 s and tpot <= 150 ms; the second does not
    assert row["goodput"] == pytest.approx(1.0)
    assert row["ttft_ms_p50"] == pytest.approx(300.0)
    assert row["tpot_ms_mean"] == pytest.approx(150.0)  # of the two multi-token requests
    assert row["itl_ms_mean"] == pytest.approx((10 * 100 + 4 * 200) / 14)
    assert row["e2el_ms_p50"] == pytest.approx(1200.0)
    assert summarize(_results(), 2.0)["goodput"] is None


def test_goodput_needs_every_slo_met() -> None:
    r = RequestResult(True, 1, 3, ttft=0.1, latency=0.5)  # tpot 0.2 s
    assert meets(r, {"ttft": 100, "tpot": 200, "e2el": 500})
    assert not meets(r, {"ttft": 100, "tpot": 199})
    assert not meets(r, {"e2el": 499})
    assert not meets(RequestResult(False, 1), {})


# ------------------------------------------------------------------------------- spec decode
EXPOSITION = """# HELP vllm:spec_decode_num_drafts_total Tree rounds verified
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{model_name="tiny"} 10.0
vllm:spec_decode_num_drafts_created{model_name="tiny"} 1.7e+09
vllm:spec_decode_num_draft_tokens_total{model_name="tiny"} 80.0
vllm:spec_decode_num_accepted_tokens_total{model_name="tiny"} 25.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="tiny",position="0"} 10.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="tiny",position="1"} 9.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="tiny",position="2"} 6.0
specdec_verify_forward_seconds_sum 1.5
"""


def test_spec_decode_counters_are_read_by_label_and_differenced() -> None:
    now = SpecDecode.parse(EXPOSITION)
    assert now == SpecDecode(10.0, 80.0, 25.0, (10.0, 9.0, 6.0))
    assert SpecDecode.parse("") == SpecDecode()
    before = SpecDecode(4.0, 30.0, 10.0, (4.0, 4.0))
    f = spec_decode_figures(now - before)
    assert (f["spec_decode_num_drafts"], f["spec_decode_num_draft_tokens"]) == (6, 50)
    assert f["spec_decode_num_accepted_tokens"] == 15
    assert f["spec_decode_num_accepted_tokens_per_pos"] == [6, 5, 6]
    assert f["acceptance_rate"] == pytest.approx(15 / 50)
    assert f["mean_acceptance_length"] == pytest.approx(1 + 15 / 6)  # vLLM's: the bonus token too
    assert f["acceptance_rate_per_pos"] == pytest.approx([1.0, 5 / 6, 1.0])
    nothing = spec_decode_figures(SpecDecode())  # ar drafts nothing
    assert nothing["acceptance_rate"] is None and nothing["mean_acceptance_length"] is None


def test_identical_outputs_compares_request_by_request() -> None:
    def ok(ids: list[int]) -> RequestResult:
        return RequestResult(True, 3, len(ids), output_ids=ids)

    ref = [ok([1, 2]), ok([3])]
    assert identical_outputs([ok([1, 2]), ok([3])], ref, True) is True
    assert identical_outputs([ok([1, 2]), ok([4])], ref, True) is False
    # a failed request is the row's `failed`, not a difference: the completed ones are compared
    assert identical_outputs([ok([1, 2]), RequestResult(False, 3, error="x")], ref, True) is True
    assert identical_outputs([ok([1, 5]), RequestResult(False, 3, error="x")], ref, True) is False
    assert identical_outputs([ok([1, 2]), ok([3])], [ok([1, 2]), RequestResult(False, 3)], True) is True
    assert identical_outputs([ok([1, 2]), ok([3])], None, True) is None  # no ar run
    assert identical_outputs([ok([1, 2]), ok([3])], ref, False) is None  # sampled
    assert identical_outputs([RequestResult(False, 3)] * 2, ref, True) is None  # nothing to compare


# ------------------------------------------------------------------------------- arrivals
def test_arrivals_are_seeded_and_start_at_zero() -> None:
    a = arrival_times(50, 4.0, 1.0, seed=3)
    assert a == arrival_times(50, 4.0, 1.0, seed=3) and a != arrival_times(50, 4.0, 1.0, seed=4)
    assert a[0] == 0.0 and bool(np.all(np.diff(a) >= 0)) and len(a) == 50
    assert arrival_times(5, math.inf, 1.0, 0) == [0.0] * 5
    assert arrival_times(0, 1.0, 1.0, 0) == []


def test_arrival_gaps_have_mean_one_over_rate_and_burstiness_sets_their_spread() -> None:
    """Gamma gaps of shape b, scale 1/(rate*b): mean 1/rate, coefficient of variation 1/sqrt(b)."""
    for b in (0.25, 1.0, 4.0):
        gaps = np.diff(arrival_times(20_001, 8.0, b, seed=0))
        assert gaps.mean() == pytest.approx(1 / 8.0, rel=0.05)
        assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(b), rel=0.08)
    with pytest.raises(ValueError):
        arrival_times(3, 0.0, 1.0, 0)
    with pytest.raises(ValueError):
        arrival_times(3, 1.0, 0.0, 0)


# ------------------------------------------------------------------------------- long prompts
def _words(text: str) -> int:
    return len(text.split())


PIECES = [f"piece{i} " + " ".join(f"w{i}_{j}" for j in range(5 + 3 * i)) for i in range(12)]


def test_long_prompts_land_in_the_range_and_are_seeded() -> None:
    out = build_long_prompts(PIECES, 6, 40, 55, seed=1, count=_words)
    assert len(out) == 6 and all(40 <= _words(p) <= 55 for p in out)
    assert out == build_long_prompts(PIECES, 6, 40, 55, seed=1, count=_words)
    assert out != build_long_prompts(PIECES, 6, 40, 55, seed=2, count=_words)
    assert all(p.split()[0].startswith("piece") for p in out)  # whole pieces first


def test_long_prompts_end_at_their_drawn_length_not_piled_at_max() -> None:
    """A prompt stops at its own drawn length (the piece that passes it is cut), so the lengths
    spread over [MIN, MAX] instead of the overshooting ones being cut to MAX."""
    lo, hi = 40, 400
    out = build_long_prompts(PIECES, 10, lo, hi, seed=3, count=_words)
    assert [_words(p) for p in out] == prompt_targets(10, lo, hi, 3)
    assert len(set(prompt_targets(10, lo, hi, 3))) > 5


def test_a_piece_that_would_pass_max_is_cut_at_a_word() -> None:
    big = ["a " * 500]
    (p,) = build_long_prompts(big, 1, 10, 12, seed=0, count=_words)
    assert 10 <= _words(p) <= 12
    # exactly one length allowed and pieces far longer than it: still hit
    assert [_words(p) for p in build_long_prompts(PIECES, 3, 17, 17, 5, _words)] == [17] * 3


def test_long_prompts_refuse_what_cannot_be_built() -> None:
    with pytest.raises(ValueError, match="MIN <= MAX"):
        build_long_prompts(PIECES, 1, 20, 10, 0, _words)
    with pytest.raises(ValueError, match="MIN <= MAX"):
        build_long_prompts(["", "  "], 1, 1, 10, 0, _words)
    with pytest.raises(ValueError, match="not within"):  # a counter that never grows
        build_long_prompts(PIECES, 1, 5, 10, 0, lambda t: 1)


# ------------------------------------------------------------------------------- flags
def test_flag_types() -> None:
    assert serve.rates("1, 2.5,inf") == [1.0, 2.5, math.inf]
    assert serve.token_range("500:1500") == (500, 1500)
    assert serve.slo("tpot:50") == ("tpot", 50.0)
    for parse, bad in (
        (serve.rates, "0"),
        (serve.rates, "x"),
        (serve.token_range, "10:5"),
        (serve.token_range, "10"),
        (serve.slo, "itl:5"),
        (serve.slo, "ttft:-1"),
    ):
        with pytest.raises(argparse.ArgumentTypeError):
            parse(bad)


def test_an_unknown_client_kind_is_a_usage_error_listing_the_kinds(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exc:
        serve.main(["--clients", "ar,edge9", "--model", "tiny"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "unknown kind edge9" in err and "available: ar" in err
    assert "budget_prespec" in err and "tree_prespec" in err  # every edge mode bench.end_to_end.network runs


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--rtt-ms", "-5"], "--rtt-ms"),
        (["--rtt-ms", "x"], "--rtt-ms"),
        (["--clients", "ar,tree", "--ignore-eos"], "--ignore-eos"),
        (["--clients", "tree_rrs"], "--temperature > 0"),
        (["--clients", "tree", "--model", "/no/such/target"], "--draft"),
        (["--clients", "tree", "--tree", "a,b"], "--tree"),
    ],
)
def test_bad_input_is_one_usage_line(argv: list[str], says: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        serve.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("python -m bench serve: error: ") and says in err


def test_every_edge_kind_maps_to_an_sdk_configuration() -> None:
    from bench.serving.serve_clients import edge_kind, edge_kinds
    from shared.messages import Mode
    from shared.tree import ExpansionConfig

    tree = ExpansionConfig.parse("2,1")
    assert {"sequence", "tree", "tree_prespec", "budget", "budget_prespec"} <= set(edge_kinds())
    assert "ar" not in edge_kinds()  # ar is the HTTP kind
    for name in edge_kinds():
        v, gen_args = edge_kind(name, tree, 0.7)
        assert not v.ar and gen_args["mode"] not in (Mode.AR, "ar")
    v, gen_args = edge_kind("budget_prespec", tree, 0.0)
    assert v.prespec and gen_args == {"mode": Mode.GREEDY}
    assert edge_kind("tree", tree, 0.7)[1] == {"mode": Mode.MATCH}
    assert edge_kind("tree_rrs", tree, 0.7)[1] == {"mode": Mode.RRS}
    assert edge_kind("auto", tree, 0.0)[1]["mode"] == "auto"  # the SDK plans its own rounds
    with pytest.raises(ValueError, match="available: ar, "):
        edge_kind("nope", tree, 0.0)


def test_help_explains_every_flag() -> None:
    p = serve.build_parser()
    for action in p._actions:
        assert action.help, action.option_strings


# ------------------------------------------------------------------------------- end to end
def test_a_short_run_on_tiny_completes_every_request(tmp_path: Path) -> None:
    out = tmp_path / "serve.json"
    argv = ["--model", "tiny", "--in-process", "--num-prompts", "4", "--max-tokens", "6", "--ignore-eos"]
    argv += ["--prompt-tokens", "60:80", "--max-concurrency", "2", "--goodput", "ttft:600000"]
    assert serve.main([*argv, "--no-progress", "--json", str(out), "--plot", str(tmp_path / "p.png")]) == 0
    doc = json.loads(out.read_text())
    assert {"config", "rows", "complete"} <= set(doc) and doc["complete"] is True
    assert doc["config"]["num_prompts"] == 4 and doc["config"]["goodput"] == {"ttft": 600000.0}
    assert all(60 <= n <= 80 for n in doc["prompt_lengths"])
    (row,) = doc["rows"]
    assert (row["client"], row["request_rate"]) == ("ar", math.inf)
    assert (row["completed"], row["failed"], row["errors"]) == (4, 0, [])
    assert row["total_output_tokens"] == 4 * 6  # ignore_eos: every request runs to max_tokens
    assert row["goodput"] == pytest.approx(row["request_throughput"])
    assert 0 < row["ttft_ms_p50"] <= row["ttft_ms_p99"] and row["tpot_ms_p50"] > 0
    assert row["verifier_busy_s"] > 0 and row["verifier_busy_s_per_token"] > 0
    assert row["preemptions"] == 0
    assert (tmp_path / "p.png").stat().st_size > 0


def test_edge_kinds_and_ar_on_the_same_arrivals_through_the_delay_proxy(tmp_path: Path) -> None:
    """ar and two edge kinds (the tiny verifier in this process, the same weights drafting with
    torch), greedy, at two rates through a 10 ms delay proxy: every edge output is ar's, the
    spec-decode counters moved for the edge kinds only."""
    out = tmp_path / "serve.json"
    argv = ["--model", "tiny", "--in-process", "--clients", "ar,tree,budget_prespec", "--rtt-ms", "10"]
    argv += ["--num-prompts", "3", "--max-tokens", "10", "--request-rate", "inf,8", "--no-progress"]
    assert serve.main([*argv, "--json", str(out), "--plot", str(tmp_path / "p.png")]) == 0
    doc = json.loads(out.read_text())
    assert doc["complete"] is True and doc["config"]["draft"] == "tiny" and doc["config"]["rtt_ms"] == 10
    assert "api_key" not in doc["config"]
    rows = {(r["client"], r["request_rate"]): r for r in doc["rows"]}
    assert list(rows) == [(c, r) for c in ("ar", "tree", "budget_prespec") for r in (math.inf, 8.0)]
    for (client, _), row in rows.items():
        assert (row["completed"], row["failed"]) == (3, 0), row["errors"]
        assert row["identical_to_ar"] is True, client
        assert row["verifier_busy_s_per_token"] > 0 and row["rtt_ms"] == 10
        assert row["ttft_ms_p50"] > 5  # at least one one-way delay each way
        assert row["e2el_ms_p50"] >= row["ttft_ms_p50"] and row["itl_ms_p50"] > 0
        for key in ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "acceptance_rate_per_pos"):
            assert key in row
        if client == "ar":
            assert row["spec_decode_num_drafts"] == 0 and row["mean_acceptance_length"] is None
        else:
            assert row["spec_decode_num_drafts"] > 0 and row["spec_decode_num_draft_tokens"] > 0
            assert 0 < row["acceptance_rate"] <= 1 and row["mean_acceptance_length"] > 1
            assert len(row["spec_decode_num_accepted_tokens_per_pos"]) >= 1
    outputs = {(o["client"], o["request_rate"]): o["ids"] for o in doc["output_ids"]}
    assert outputs[("tree", 8.0)] == outputs[("ar", 8.0)] and all(outputs[("ar", 8.0)])
    assert (tmp_path / "p.png").stat().st_size > 0


def test_a_server_that_is_not_there_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    from bench.harness import free_port

    url = f"http://127.0.0.1:{free_port()}"
    assert serve.main(["--url", url, "--num-prompts", "2", "--no-progress"]) == 1
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert (
        len(lines) == 1 and lines[0].startswith("bench.serving.serve: ") and "Traceback" not in captured.err
    )
