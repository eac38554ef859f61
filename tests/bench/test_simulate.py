"""bench.simulation.simulate: the replay of logged rounds on hand-built traces with known answers, the cost
curves, the CLI, and the validation on a real small-pair trace (the co-located replay reproduces
the measured ms/token within 10%)."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest

from bench.simulation.simulate import (
    Costs,
    Curve,
    Overheads,
    Policy,
    TracedGeneration,
    fit_drafter,
    fit_verifier,
    load_generations,
    main,
    replay,
    simulate,
    trace_from_dict,
)
from edge_client.stats import DraftEvent, RoundTrace, SendEvent, VerdictEvent

V = 100.0  # ms per verification (a flat verifier curve)
D = 10.0  # ms per drafter evaluation
RTT = 50.0


def draft(t0: float, t1: float, kind: str, *evals: tuple[int, float], trees: int = 1) -> DraftEvent:
    return DraftEvent(t0, t1, kind, trees, tuple(("extend", r, ms) for r, ms in evals))


def send(
    t: float, rid: int, parent: int | None = None, prob: float = 1.0, nodes: int = 3, depth: int = 2
) -> SendEvent:
    """A tree of `nodes` nodes and `depth` levels left (depth = nodes: a chain)."""
    return SendEvent(t, rid, parent, nodes, depth, 0, prob, 100)


def verdict(t: float, rid: int, nxt: int | None, done: bool = False, tokens: int = 4) -> VerdictEvent:
    return VerdictEvent(t, rid, tokens - 1, tokens, V, nxt is not None and not done, nxt, done)


def gen(tr: RoundTrace, wall_ms: float | None = None, rtt: float = RTT) -> TracedGeneration:
    """A generation whose measured wall time is the logged span (nothing outside the rounds)."""
    tokens = sum(v.tokens for v in tr.verdicts)
    span = (tr.verdicts[-1].t - min(d.t0 for d in tr.drafts)) * 1e3
    wall = span if wall_ms is None else wall_ms
    return TracedGeneration(tr, tokens, wall / tokens, "tree_prespec", rtt)


FLAT = Costs("flat-test", Curve.flat(D), Curve.flat(V), prefill="curve")


def all_hits(rounds: int) -> RoundTrace:
    """Every round's tree drafted one after the other from the start (conditional trees of
    conditional trees); every verdict hits the next one; verdict times as the model has them."""
    drafts = [draft(0.0, 0.01, "plain", (5, D))]
    sends = [send(0.01, 0)]
    verdicts = []
    for j in range(rounds):
        if j < rounds - 1:
            t = 0.01 * (j + 1)
            drafts.append(draft(t, t + 0.01, "conditional", (3, D)))
            sends.append(send(t + 0.01, j + 1, parent=j, prob=0.8))
        last = j == rounds - 1
        verdicts.append(verdict(0.16 + 0.1 * j, j, None if last else j + 1, done=last))
    return RoundTrace(sends, verdicts, drafts)


def all_misses(rounds: int) -> RoundTrace:
    """Every round drafted synchronously after the previous verdict (no pre-speculation)."""
    drafts, sends, verdicts = [], [], []
    for j in range(rounds):
        t = 0.16 * j
        drafts.append(draft(t, t + 0.01, "plain", (5, D)))
        sends.append(send(t + 0.01, j))
        verdicts.append(verdict(0.16 * (j + 1), j, None, done=j == rounds - 1))
    return RoundTrace(sends, verdicts, drafts)


# ----------------------------------------------------------------------------- known answers
def test_all_hits_cost_a_verification_a_round() -> None:
    r = replay(gen(all_hits(3)), FLAT)
    # first draft D, up RTT/2, then three verifications back to back, down RTT/2
    assert r.span_ms == pytest.approx(D + RTT / 2 + 3 * V + RTT / 2)
    assert r.ms_per_token == pytest.approx(r.span_ms / 12)
    assert (r.hits, r.decided, r.stall_ms, r.miss_draft_ms) == (2, 2, 0.0, 0.0)
    long = replay(gen(all_hits(40)), FLAT)
    assert long.ms_per_token == pytest.approx(V / 4, rel=0.02)  # V / tau: nothing else is on the path


def test_all_misses_cost_verify_round_trip_and_drafting() -> None:
    r = replay(gen(all_misses(3)), FLAT)
    assert r.span_ms == pytest.approx(3 * (D + RTT + V))
    assert r.hits == 0 and r.miss_draft_ms == pytest.approx(2 * D)
    # the round trip is on the critical path of every round: each ms of RTT costs a ms a round
    r100 = replay(gen(all_misses(3)), FLAT, Policy(rtt_ms=RTT + 100))
    assert r100.span_ms - r.span_ms == pytest.approx(3 * 100)
    # ... and with every round a hit, only once
    h100 = replay(gen(all_hits(3)), FLAT, Policy(rtt_ms=RTT + 100))
    assert h100.span_ms - replay(gen(all_hits(3)), FLAT).span_ms == pytest.approx(100)


def test_a_late_hit_stalls_the_verifier_until_its_tree_arrives() -> None:
    slow = 300.0  # the conditional draft outlasts the verification in flight
    tr = RoundTrace(
        [send(0.01, 0), send(0.31, 1, parent=0)],
        [verdict(0.2, 0, 1), verdict(0.5, 1, None, done=True)],
        [draft(0.0, 0.01, "plain", (5, D)), draft(0.01, 0.31, "conditional", (3, slow))],
    )
    colocated = Costs("colocated", None, Curve.flat(V), prefill="curve")  # the logged draft ms
    r = replay(gen(tr), colocated)
    first_verdict_ends = D + RTT / 2 + V
    arrives = D + slow + RTT / 2
    assert r.stall_ms == pytest.approx(arrives - first_verdict_ends)
    assert r.span_ms == pytest.approx(arrives + V + RTT / 2)
    assert r.hits == 1  # still a hit, but a late one
    # a drafter 30x faster: the hit is on time again
    fast = replay(gen(tr), Costs("fast", Curve.flat(D), Curve.flat(V), prefill="curve"))
    assert fast.stall_ms == 0.0 and fast.span_ms == pytest.approx(D + RTT / 2 + 2 * V + RTT / 2)


def test_a_miss_abandons_the_conditional_draft_after_its_current_evaluation() -> None:
    step = 100.0
    tr = RoundTrace(
        [send(0.01, 0), send(0.31, 1, parent=0), send(0.32, 2)],
        [verdict(0.15, 0, None), verdict(0.5, 2, None, done=True)],
        [
            draft(0.0, 0.01, "plain", (5, D)),
            draft(0.01, 0.31, "conditional", (3, step), (3, step), (3, step)),
            draft(0.31, 0.32, "plain", (1, D)),
        ],
    )
    r = replay(gen(tr), Costs("colocated", None, Curve.flat(V), prefill="curve"))
    miss_at = D + RTT / 2 + V + RTT / 2  # 160: during the conditional draft's second evaluation
    cut = D + 2 * step  # it stops when that evaluation ends (210)
    assert miss_at < cut
    assert r.span_ms == pytest.approx(cut + D + RTT / 2 + V + RTT / 2)
    assert r.miss_draft_ms == pytest.approx(D)


def lockstep_pair() -> RoundTrace:
    """Round 0's two likeliest outcomes drafted in one lockstep action (4 rows: 2 per tree); the
    verdict hits the less likely one."""
    return RoundTrace(
        [send(0.02, 0), send(0.03, 1, parent=0, prob=0.6), send(0.03, 2, parent=0, prob=0.3)],
        [verdict(0.2, 0, 2), verdict(0.3, 2, None, done=True)],
        [draft(0.0, 0.02, "plain", (5, D), (1, D)), draft(0.02, 0.03, "conditional", (4, D), trees=2)],
    )


def test_fewer_outcomes_turn_hits_on_the_dropped_ones_into_misses() -> None:
    rows_seen: list[float] = []
    drafter = Curve(((1.0, 5.0), (2.0, 10.0), (4.0, 20.0), (5.0, 25.0)))  # 5 ms a row

    def spy(rows: float) -> float:
        rows_seen.append(rows)
        return drafter(rows)

    class Spy(Curve):
        def __call__(self, rows: float) -> float:
            return spy(rows)

    costs = Costs("t", Spy(drafter.points), Curve.flat(V), prefill="curve")
    logged = replay(gen(lockstep_pair()), costs)
    first = 25.0 + 5.0
    assert logged.hits == 1
    assert logged.span_ms == pytest.approx(first + RTT / 2 + 2 * V + RTT / 2)
    assert 4.0 in rows_seen
    rows_seen.clear()
    one = replay(gen(lockstep_pair()), costs, Policy(n=1, backup_ms=30.0))
    assert one.hits == 0  # the tree verified was the second likeliest: not drafted with N = 1
    assert 2.0 in rows_seen and 4.0 not in rows_seen  # the lockstep draft evaluates one tree's rows
    verdict0 = first + RTT / 2 + V + RTT / 2
    assert one.span_ms == pytest.approx(verdict0 + 30.0 + RTT / 2 + V + RTT / 2)
    assert one.miss_draft_ms == pytest.approx(30.0)
    # N as large as the log's: the logged policy, and the rows say so
    assert replay(gen(lockstep_pair()), costs, Policy(n=2)).span_ms == pytest.approx(logged.span_ms)
    rows, _ = simulate([gen(lockstep_pair())], {"t": costs}, [Policy(n=1), Policy(n=2), Policy(n=5)])
    assert [r.as_dict()["n_as_logged"] for r in rows] == [False, True, True]


def test_fewer_outcomes_shorten_a_schedule_of_chains() -> None:
    """Three chains drafted together (rows per evaluation 3, 3, 2, 1: depths 4, 3 and 2); N = 2
    keeps the two likeliest, the deepest: every evaluation holds at most 2 rows."""
    chains = [send(0.04, 1, 0, 0.5, 4, 4), send(0.04, 2, 0, 0.3, 3, 3), send(0.04, 3, 0, 0.1, 2, 2)]
    tr = RoundTrace(
        [send(0.01, 0), *chains],
        [verdict(0.2, 0, 1), verdict(0.3, 1, None, done=True)],
        [
            draft(0.0, 0.01, "plain", (5, D)),
            draft(0.01, 0.04, "conditional", (3, 7.0), (3, 7.0), (2, 6.0), (1, 5.0), trees=3),
        ],
    )
    seen: list[float] = []

    class Spy(Curve):
        def __call__(self, rows: float) -> float:
            seen.append(rows)
            return 4.0 + rows

    costs = Costs("t", Spy(((1.0, 5.0),)), Curve.flat(V), prefill="curve")
    replay(gen(tr), costs, Policy(n=2))
    assert seen == [5, 2, 2, 2, 1]
    # co-located, the logged ms of fewer rows follow the generation's own cost per row count
    r = replay(gen(tr), Costs("colocated", None, Curve.flat(V), prefill="curve"), Policy(n=1))
    assert r.prespec_ms == pytest.approx(5.0 * 4 + 5.0)  # 1 row at each evaluation, + 5 ms outside them


def test_backup_ms_prices_the_logs_own_miss_paths() -> None:
    base = replay(gen(all_misses(4)), FLAT)
    cheap = replay(gen(all_misses(4)), FLAT, Policy(backup_ms=2.0))
    assert base.span_ms - cheap.span_ms == pytest.approx(3 * (D - 2.0))  # the first tree is no miss path


def chained_rounds() -> RoundTrace:
    """Round 0 (a plain tree) hits round 1, a conditional chain 4 deep that accepts 2 nodes (3
    tokens) and hits round 2, a chain 2 deep that accepts 2 (3 tokens): 10 tokens."""
    return RoundTrace(
        [send(0.02, 0), send(0.06, 1, 0, 0.8, 4, 4), send(0.24, 2, 1, 0.8, 2, 2)],
        [
            VerdictEvent(0.2, 0, 3, 4, V, True, 1, False),
            VerdictEvent(0.3, 1, 2, 3, V, True, 2, False),
            VerdictEvent(0.4, 2, 2, 3, V, False, None, True),
        ],
        [
            draft(0.0, 0.02, "plain", (5, D), (1, D)),
            draft(0.02, 0.06, "conditional", (1, D), (1, D), (1, D), (1, D)),
            draft(0.22, 0.24, "conditional", (1, D), (1, D)),
        ],
    )


def test_a_chain_depth_cap_drafts_less_and_loses_what_the_chain_had_accepted_beyond_it() -> None:
    logged = replay(gen(chained_rounds()), FLAT)
    assert (logged.tokens, logged.hits, logged.tokens_lost) == (10, 2, 0)
    # cap 3: round 1's chain is drafted 3 deep (an evaluation fewer); it accepted 2, so the same round
    three = replay(gen(chained_rounds()), FLAT, Policy(depth=3))
    assert (three.tokens, three.hits, three.tokens_lost) == (10, 2, 0)
    assert three.prespec_ms == pytest.approx(logged.prespec_ms - D)
    assert three.span_ms == pytest.approx(logged.span_ms)  # the chain was ready long before its round
    # cap 1: round 1 gives 2 tokens, not 3, and another outcome (all accepted, the chain's own next
    # node as the bonus). Round 2 keeps its hit and timing, only the token is lost
    upper = replay(gen(chained_rounds()), FLAT, Policy(depth=1))
    assert (upper.tokens, upper.hits, upper.tokens_lost) == (8, 2, 2)  # round 2 (2 deep) lost one too
    assert upper.span_ms == pytest.approx(logged.span_ms)
    assert upper.prespec_ms == pytest.approx(logged.prespec_ms - 4 * D)  # 3 evaluations fewer, then 1
    # "then a miss": round 2's tree (pre-speculated for the logged outcome) is useless, so its hit is a
    # miss with a synchronous draft (as long as the first tree's drafting without its sync: 2
    # evaluations) and the round trip on the path
    one = replay(gen(chained_rounds()), FLAT, Policy(depth=1, depth_miss=True))
    assert (one.tokens, one.hits, one.tokens_lost) == (9, 1, 1)  # round 2 is a miss path's tree: not capped
    assert one.miss_draft_ms == pytest.approx(2 * D)
    assert one.span_ms - logged.span_ms == pytest.approx(RTT + 2 * D)
    # a cap at or beyond every chain's depth is the log
    assert replay(gen(chained_rounds()), FLAT, Policy(depth=4)).span_ms == pytest.approx(logged.span_ms)
    # co-located, the shortened chain's logged verification is scaled along the generation's own fit
    colocated = Costs("colocated")
    assert replay(gen(chained_rounds()), colocated, Policy(depth=3)).verify_ms == pytest.approx(
        replay(gen(chained_rounds()), colocated).verify_ms
    )  # every logged verification took V: a flat fit, nothing to scale


def test_the_colocated_replay_of_its_own_timeline_is_exact() -> None:
    """A log whose times follow the model (verify, RTT, drafting) replays to its own span."""
    drafts = [draft(0.0, 0.01, "plain", (5, 10.0))]
    sends = [send(0.01, 0)]
    # round 0 verified 35..135 ms, verdict at 160; r1 drafted 10..20, verified 135..235, verdict 260
    drafts.append(draft(0.01, 0.02, "conditional", (3, 10.0)))
    sends.append(send(0.02, 1, parent=0))
    verdicts = [verdict(0.16, 0, 1), verdict(0.26, 1, None)]
    # a miss: drafted 260..270, verified 295..395, verdict at 420
    drafts.append(draft(0.26, 0.27, "plain", (1, 10.0)))
    sends.append(send(0.27, 2))
    verdicts.append(verdict(0.42, 2, None, done=True))
    tr = RoundTrace(sends, verdicts, drafts)
    g = gen(tr, wall_ms=450.0)  # 30 ms outside the rounds (before the first draft, after the last)
    r = replay(g, Costs("colocated"))
    assert r.span_ms == pytest.approx(420.0)
    assert r.ms == pytest.approx(450.0) and r.ms_per_token == pytest.approx(g.ms_per_token)


def test_overheads_are_measured_from_the_rounds() -> None:
    tr = RoundTrace(
        [send(0.01, 0), send(0.02, 1, parent=0), send(0.28, 2)],
        [verdict(0.16, 0, 1), verdict(0.27, 1, None), verdict(0.45, 2, None, done=True)],
        [
            draft(0.0, 0.01, "plain", (5, D)),
            draft(0.01, 0.02, "conditional", (3, D)),
            draft(0.27, 0.28, "plain"),
        ],
    )
    over = Overheads.measure([gen(tr)])
    assert over.server == pytest.approx(10.0)  # 270 - 160 - 100 between back-to-back verifications
    assert over.link == pytest.approx(20.0)  # 450 - 280 - 100 - 50 on the round sent after a miss


# ----------------------------------------------------------------------------- curves and files
def test_curves_interpolate_and_extrapolate_and_load(tmp_path: Path) -> None:
    c = Curve(((1.0, 10.0), (4.0, 16.0), (8.0, 32.0)))
    assert [c(0), c(1), c(2), c(4), c(6), c(8), c(10)] == pytest.approx([10, 10, 12, 16, 24, 32, 40])
    assert Curve.flat(7.0)(100) == 7.0
    assert Curve.fit([(2, 5.0), (2, 9.0), (2, 6.0), (1, 3.0)]).points == ((1.0, 3.0), (2.0, 6.0))
    (tmp_path / "c.csv").write_text("rows,ms\n1,10\n4,16\n8,32\n")
    (tmp_path / "a.json").write_text(json.dumps({"rows": [1, 4, 8], "ms": [10, 16, 32]}))
    (tmp_path / "b.json").write_text(json.dumps([[1, 10], [4, 16], [8, 32]]))
    (tmp_path / "d.json").write_text(json.dumps({"1": 10, "4": 16, "8": 32}))
    (tmp_path / "e.json").write_text(
        json.dumps({"model": "m", "verify_cost_ms": {"1": 10, "4": 16, "8": 32}})
    )
    for name in ("c.csv", "a.json", "b.json", "d.json", "e.json"):
        assert Curve.load(tmp_path / name) == c
    with pytest.raises(ValueError):
        Curve(((2.0, 1.0), (1.0, 1.0)))


def test_curves_fit_from_the_trace() -> None:
    g = gen(all_hits(3))
    assert fit_drafter([g]).points == ((3.0, D), (5.0, D))
    assert fit_verifier([g]).points == ((3.0, V),)  # by tree nodes; round 0 (its prefill) left out


def trace_file(path: Path, gens: list[TracedGeneration], ar_ms_per_token: float = 80.0) -> Path:
    """The generations as a bench.end_to_end.network --trace file (and one mode-ar generation)."""
    doc = {
        "config": {"note": "hand-built"},
        "generations": [
            {
                "mode": g.mode,
                "rtt_ms": g.rtt_ms,
                "temperature": g.temperature,
                "prompt_index": i,
                "trace": g.trace.as_dict(),
                "stats": {"tokens": g.tokens, "ms_per_token": g.ms_per_token},
            }
            for i, g in enumerate(gens)
        ]
        + [
            {
                "mode": "ar",
                "rtt_ms": RTT,
                "temperature": 0.0,
                "prompt_index": 0,
                "trace": RoundTrace().as_dict(),
                "stats": {"tokens": 10, "ms_per_token": ar_ms_per_token},
            }
        ],
    }
    path.write_text(json.dumps(doc))
    return path


def test_trace_round_trips_through_json(tmp_path: Path) -> None:
    tr = all_hits(3)
    assert trace_from_dict(json.loads(json.dumps(tr.as_dict()))) == tr
    spec, ar = load_generations([trace_file(tmp_path / "t.json", [gen(tr)])])
    assert len(spec) == 1 and len(ar) == 1 and spec[0].trace == tr


def test_cli_prints_and_writes_every_scenario_and_policy(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    f = trace_file(tmp_path / "t.json", [gen(all_hits(4)), gen(all_misses(3))])
    out = tmp_path / "sim.json"
    assert main([str(f), "--rtt-ms", "0,100", "--backup-ms", "5", "--json", str(out), "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert "colocated" in text and "separate" in text and "flat" in text
    doc = json.loads(out.read_text())
    rows = doc["rows"]
    assert len(rows) == 3 * 6  # three scenarios x (RTT logged/0/100 x T_b logged/5)
    logged = [r for r in rows if r["scenario"] == "colocated" and r["policy"] == "logged"]
    assert len(logged) == 1 and logged[0]["measured_ms_per_token"] is not None
    assert logged[0]["x_ar"] == pytest.approx(logged[0]["ms_per_token"] / 80.0, rel=1e-3)
    assert len(logged[0]["per_generation_ms_per_token"]) == 2
    by = {(r["scenario"], r["rtt_ms"], r["backup_ms"]): r["ms_per_token"] for r in rows}
    assert by[("separate", 0.0, None)] < by[("separate", None, None)] < by[("separate", 100.0, None)]
    with pytest.raises(SystemExit):
        main([str(f), "--scenarios", "gpu"])


def test_cli_replays_each_depth_cap_in_both_readings(tmp_path: Path) -> None:
    f = trace_file(tmp_path / "t.json", [gen(chained_rounds())])
    out = tmp_path / "sim.json"
    assert main([str(f), "--depth", "1", "--scenarios", "flat", "--json", str(out), "--no-progress"]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["policy"], r["depth"], r["tokens_lost"]) for r in rows] == [
        ("logged", None, 0),
        ("depth 1", 1, 2),
        ("depth 1 (then a miss)", 1, 1),
    ]
    with pytest.raises(SystemExit):
        main([str(f), "--depth", "0"])


def test_separate_machines_take_the_given_verifier_curve(tmp_path: Path) -> None:
    f = trace_file(tmp_path / "t.json", [gen(all_hits(4))])
    curve = tmp_path / "v.json"
    curve.write_text(json.dumps({"verify_cost_ms": {"1": 20.0, "3": 40.0}}))
    out = tmp_path / "sim.json"
    args = [
        str(f),
        "--verifier-curve",
        str(curve),
        "--flat-verifier",
        "15",
        "--json",
        str(out),
        "--no-progress",
    ]
    assert main(args) == 0
    rows = {r["scenario"]: r for r in json.loads(out.read_text())["rows"]}
    # round 0 keeps its logged time (it holds the prompt's prefill), the others cost V(3 nodes)
    assert rows["separate"]["verify_ms_per_round"] == pytest.approx((V + 3 * 40.0) / 4)
    assert rows["flat"]["verify_ms_per_round"] == pytest.approx(15.0)
    assert rows["separate"]["x_ar"] == pytest.approx(rows["separate"]["ms_per_token"] / 20.0, rel=1e-3)
    # all hits: a round costs a verification, so the flat verifier is the fastest
    assert rows["flat"]["ms_per_token"] < rows["separate"]["ms_per_token"] < rows["colocated"]["ms_per_token"]


def test_the_flat_scenario_takes_a_gpu_checks_measured_forward_curve(tmp_path: Path) -> None:
    """--flat-curve with a `bench.kernels.gpu_forward --json` file: the first attention mode's forward ms by
    rows is the flat scenario's verifier (a 3-node tree costs V(3), not the one-row step)."""
    f = trace_file(tmp_path / "t.json", [gen(all_hits(4))])
    gpu = tmp_path / "gpu_forward.json"
    rows_ms = {"1": 10.0, "3": 16.0, "1000": 16.0}
    gpu.write_text(
        json.dumps(
            {
                "config": {"device": "cuda"},
                "rows": [
                    {"attention": "model", "forward_ms": rows_ms, "decode_tok_s": 60.0},
                    {"attention": "sdpa", "forward_ms": {"1": 1.0, "64": 1.0}},
                ],
            }
        )
    )
    assert Curve.load(gpu) == Curve(((1.0, 10.0), (3.0, 16.0), (1000.0, 16.0)))
    out = tmp_path / "sim.json"
    args = [str(f), "--flat-curve", str(gpu), "--flat-verifier", "99", "--scenarios", "flat"]
    assert main([*args, "--json", str(out), "--no-progress"]) == 0
    doc = json.loads(out.read_text())
    (row,) = doc["rows"]
    assert row["scenario"] == "flat" and row["verify_ms_per_round"] == pytest.approx(16.0)
    (group,) = doc["groups"].values()
    assert group["flat_verifier_ms"] == 10.0 and group["flat_source"] == str(gpu)
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(SystemExit):
        main([str(f), "--flat-curve", str(bad)])


def test_help_explains_every_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    flags = (
        "--drafter-curve",
        "--verifier-curve",
        "--flat-verifier",
        "--flat-curve",
        "--rtt-ms",
        "--n",
        "--backup-ms",
        "--depth",
    )
    for flag in flags:
        assert flag in text
    assert "--json" in text and "--scenarios" in text


# ----------------------------------------------------------------------------- the validation
def record_small_pair(
    prompts: int = 3, tokens: int = 48, rtt_ms: float = 50.0, temperature: float = 0.0
) -> list[TracedGeneration]:
    """Traced generations of the small pair (smollm2-135m verifying in this process, its Q4
    llama.cpp export drafting), tree + pre-speculation over an emulated RTT; greedy, or seeded
    match at `temperature`."""
    from bench.harness import load_prompts
    from bench.lib.shaper import LinkShape
    from edge_client.client import EdgeClient, TreeSpec
    from edge_client.drafters.registry import create_drafter
    from shared.model import load_target
    from tests.cloud_verifier.service import LiveServer

    target = load_target("smollm2-135m", progress=False)
    drafter = create_drafter("llama_cpp", "smollm2-135m-q4", n_threads=1)
    out: list[TracedGeneration] = []

    async def run(url: str) -> None:
        link = LinkShape.rtt(rtt_ms)
        async with EdgeClient(url, drafter, tree=TreeSpec(), prespec=True, link=link, trace=True) as c:
            async for _ in c.generate("Hello", max_new_tokens=4):
                pass  # warm up
            mode = "greedy" if temperature == 0 else "match"
            for i, p in enumerate(load_prompts(prompts)):
                gen = c.generate(p.text, max_new_tokens=tokens, temperature=temperature, seed=i, mode=mode)
                async for _ in gen:
                    pass
                assert c.last is not None
                st = c.last.stats
                assert st.trace is not None
                out.append(
                    TracedGeneration(
                        st.trace, st.tokens, st.ms_per_token, "tree_prespec", rtt_ms, temperature, i
                    )
                )

    try:
        with LiveServer(target=target, max_context=4096, max_pending=8) as srv:
            asyncio.run(run(srv.ws))
    finally:
        drafter.close()
    return out


@pytest.mark.slow
def test_the_colocated_replay_reproduces_a_real_small_pair_run(tmp_path: Path) -> None:
    t0 = time.perf_counter()
    gens = record_small_pair()
    rows, over = simulate(gens, {"colocated": Costs("colocated")}, [Policy()])
    (row,) = rows
    measured = row.measured_ms_per_token
    assert measured is not None
    err = row.ms_per_token / measured - 1
    print(
        f"validation: replayed {row.ms_per_token:.1f} ms/token vs measured {measured:.1f} "
        f"({100 * err:+.1f}%), overheads {over}, {time.perf_counter() - t0:.0f} s"
    )
    assert abs(err) < 0.10
    for rep, g in zip(row.replays, gens, strict=True):
        assert rep.ms_per_token == pytest.approx(g.ms_per_token, rel=0.2)
    # the other scenarios run on the same trace (and the CLI on its file)
    f = trace_file(tmp_path / "real.json", gens)
    assert main([str(f), "--rtt-ms", "0,100", "--n", "1", "--no-progress"]) == 0
