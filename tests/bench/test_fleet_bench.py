"""bench.serving.fleet's pure pieces, with no Ray cluster: the parts flag, the overhead rows and goal,
where resumes landed, the replicas' split and scaling, the fleet's metrics summed by a label, the
fleet a serve command line makes, and the scripted trees of the raw sessions."""

from __future__ import annotations

import argparse
import random

import pytest

from bench.lib import fleet_throughput
from bench.lib.raw_sessions import scripted_tree
from bench.lib.ray_fleet import fleet_from_flags, labelled_totals
from bench.serving import fleet as bench_fleet


def test_parts_keep_their_order_and_refuse_unknown_names() -> None:
    assert bench_fleet.parts_list("throughput, overhead") == ["overhead", "throughput"]
    assert bench_fleet.parts_list("resume") == ["resume"]
    for bad in ("", "overhead,speed", ","):
        with pytest.raises(argparse.ArgumentTypeError):
            bench_fleet.parts_list(bad)


def test_compare_gives_the_medians_and_what_the_fleet_adds() -> None:
    direct = [0.010, 0.010, 0.012, 0.011, 0.009]
    fleet = [0.012, 0.012, 0.014, 0.013, 0.011]
    row = bench_fleet.compare("verify round", direct, fleet)
    assert row["direct_median_ms"] == 10.0 and row["fleet_median_ms"] == 12.0
    assert row["added_ms"] == 2.0 and row["added_pct"] == 20.0 and row["n"] == 5
    assert row["direct_p90_ms"] == 12.0 and row["fleet_p90_ms"] == 14.0
    empty = bench_fleet.compare("nothing", [], [])
    assert empty["added_ms"] is None and empty["added_pct"] is None


def test_the_overhead_goal_is_met_by_ms_or_by_share() -> None:
    def rows(added_ms: float, pct: float) -> tuple[dict[str, float], dict[str, float]]:
        return {"added_ms": added_ms}, {"added_pct": pct}

    assert bench_fleet.overhead_goal(*rows(1.5, 30.0))["met"]  # few ms on a fast round
    assert bench_fleet.overhead_goal(*rows(4.0, 3.0))["met"]  # a small share of a slow round
    assert not bench_fleet.overhead_goal(*rows(4.0, 30.0))["met"]


def test_landed_counts_reused_and_busy_as_on_the_holder() -> None:
    got = bench_fleet.landed({"reused": 37.0, "busy": 1.0, "gone": 2.0})
    assert got["server_resumes"] == 40 and got["landed_pct"] == 95.0 and got["met"]
    assert not bench_fleet.landed({"reused": 36.0, "gone": 4.0})["met"]
    none = bench_fleet.landed({})
    assert none["landed_pct"] is None and not none["met"]


def test_the_split_leaves_out_replicas_that_emitted_nothing() -> None:
    before = {"old": 500.0, "a": 0.0}
    after = {"old": 500.0, "a": 480.0, "b": 520.0}
    assert fleet_throughput.replica_split(before, after) == "52/48"
    assert fleet_throughput.replica_split(after, after) == "-"


def test_scaling_is_two_replicas_over_one() -> None:
    rows = [{"replicas": 1, "tokens_per_s": 100.0}, {"replicas": 2, "tokens_per_s": 180.0}]
    assert bench_fleet.scaling(rows) == {"ratio": 1.8, "goal": ">= 1.7x", "met": True}
    assert not bench_fleet.scaling(rows[:1])["met"]
    # saturation: each fleet's best over the loads tried
    loads = [*rows, {"replicas": 1, "tokens_per_s": 120.0}, {"replicas": 2, "tokens_per_s": 170.0}]
    assert bench_fleet.scaling(loads)["ratio"] == 1.5
    # plain verifiers' rows (the machine's own scaling) are not the fleet's
    plain = [{**r, "system": "plain", "tokens_per_s": 10 * r["tokens_per_s"]} for r in loads]
    assert bench_fleet.scaling([*loads, *plain])["ratio"] == 1.5
    goal = {**bench_fleet.scaling(loads), "plain_ratio": 1.6}
    assert "2 plain verifiers (no Ray) give 1.6x" in bench_fleet.goal_line("throughput", goal, 2)


def test_clients_per_replica_is_a_list_of_loads() -> None:
    assert bench_fleet._counts("8,16") == [8, 16]
    for bad in ("", "0", "4,x"):
        with pytest.raises(argparse.ArgumentTypeError, match="whole numbers"):
            bench_fleet._counts(bad)


MERGED = """# HELP cloud_verifier_resumes_total Sessions resuming
# TYPE cloud_verifier_resumes_total counter
cloud_verifier_resumes_total{kv="reused",node="10.0.0.1",replica="r1"} 3.0
cloud_verifier_resumes_total{kv="gone",node="10.0.0.1",replica="r1"} 1.0
cloud_verifier_resumes_total{kv="reused",node="10.0.0.2",replica="r2"} 4.0
cloud_verifier_resumes_created{kv="reused",node="10.0.0.2",replica="r2"} 1.7e9
# HELP specdec_emitted_tokens_total Tokens sent in verdicts
# TYPE specdec_emitted_tokens_total counter
specdec_emitted_tokens_total{node="10.0.0.1",replica="r1"} 100.0
specdec_emitted_tokens_total{node="10.0.0.2",replica="r2"} 60.0
"""


def test_labelled_totals_sum_over_replicas() -> None:
    assert labelled_totals(MERGED, "cloud_verifier_resumes", "kv") == {"reused": 7.0, "gone": 1.0}
    assert labelled_totals(MERGED, "specdec_emitted_tokens", "replica") == {"r1": 100.0, "r2": 60.0}
    assert labelled_totals(MERGED, "no_such_family", "kv") == {}


def test_the_fleet_takes_the_direct_verifiers_flags() -> None:
    fleet = fleet_from_flags(
        ["--model", "tiny", "--threads", "1", "--no-measure-cost", "--kv-blocks", "2048"], 2
    )
    assert fleet.model == "tiny" and fleet.replicas_min == fleet.replicas_max == 2
    assert fleet.overrides["threads"] == 1 and fleet.overrides["kv_blocks"] == 2048
    assert fleet.overrides["measure_cost"] is False
    with pytest.raises(ValueError, match="--min-replicas"):  # what the fleet refuses is a ValueError
        fleet_from_flags(["--min-replicas", "3", "--max-replicas", "2"], 1)


def test_scripted_trees_follow_the_reference_then_err() -> None:
    committed = [5, 6, 7]
    ref_full = [*committed, 11, 12, 13, 14, 15, 16, 17, 18, 19]
    for seed in range(20):
        tree = scripted_tree(random.Random(seed), committed, ref_full, 8, 49152)
        again = scripted_tree(random.Random(seed), committed, ref_full, 8, 49152)
        assert tree.base == 3 and 1 <= tree.num_nodes <= 8
        assert tree.tokens.tolist() == again.tokens.tolist()
        assert tree.tokens.min() >= 3 and tree.tokens.max() < 49152
        assert tree.parents[0] == -1


def test_render_says_the_cores_are_shared() -> None:
    rows = [
        {"part": "throughput", "replicas": 1, "tokens_per_s": 100.0},
        {"part": "throughput", "replicas": 2, "tokens_per_s": 150.0},
    ]
    goals = {"throughput": bench_fleet.scaling(rows)}
    text = bench_fleet.render(rows, goals, 2)
    assert "1.5x, NOT met" in text and "2 CPUs here" in text and "share them with the replicas" in text


def test_bad_counts_are_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        bench_fleet.main(["--sessions", "0"])
    assert exit_.value.code == 2 and "--sessions" in capsys.readouterr().err


def test_raw_sessions_move_to_the_verifiers_own_address_where_offered() -> None:
    """bench.fleet --direct's clients: a session asking for it moves (the same tokens, one move
    counted by the verifier), one that does not stays."""
    import asyncio

    from bench.lib.raw_sessions import ar_tokens, session_load, timed_greedy
    from tests.cloud_verifier.service import LiveServer, tiny

    prompt = [5, 6, 7, 8, 9, 10, 11]
    target = tiny()
    fp, vocab = target.vocab_fingerprint, target.config.vocab_size
    with LiveServer() as server:
        server.state.direct = server.ws.replace("127.0.0.1", "localhost")
        ref = ar_tokens(server.ws, fp, prompt, 16)
        stayed, _, _ = timed_greedy(server.ws, fp, prompt, ref, 16, 0, vocab)
        moved, rounds, opened = timed_greedy(server.ws, fp, prompt, ref, 16, 0, vocab, direct=True)
        moves = server.state.metrics.direct_moves._value.get()
        tally = asyncio.run(session_load(server.ws, fp, 2, 8, (0.0, 1.5), 0, vocab, direct=True))
        moves_under_load = server.state.metrics.direct_moves._value.get() - moves
    assert stayed == moved == ref and moves == 1 and opened > 0 and len(rounds) >= 1
    assert tally.errors == [] and tally.tokens > 0 and moves_under_load >= 2


def test_the_control_planes_processes_by_kind_from_proc() -> None:
    """A child's CPU time is read from /proc and it counts under the bench's process; rows give
    each kind's % of a core and the cluster's total without the replicas."""
    import os
    import subprocess
    import sys

    from bench.lib import fleet_cpu

    assert fleet_cpu.kind("ray::ServeReplica:verifier:Verifier") == "replica"
    assert fleet_cpu.kind("/x/ray/core/src/ray/gcs/gcs_server --log_dir=/t") == "GCS"
    assert fleet_cpu.kind("ray::ServeController.listen_for_change") == "Serve controller"
    assert fleet_cpu.kind("python other.py") == "other"
    spin = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\ntime.sleep(30)"
    child = subprocess.Popen([sys.executable, "-c", spin])
    try:
        assert child.pid in fleet_cpu.descendants(os.getpid())
        deadline = 50
        while (fleet_cpu.cpu_seconds(child.pid) or 0.0) < 0.25 and deadline:
            subprocess.run(["sleep", "0.1"])
            deadline -= 1
        used = fleet_cpu.cpu_seconds(child.pid)
        assert used is not None and 0.25 <= used < 5
    finally:
        child.kill()
        child.wait()
    assert fleet_cpu.cpu_seconds(child.pid) is None  # reaped: gone
    before = {1: ("replica", 1.0), 2: ("GCS", 2.0), 3: ("raylet", 0.0)}
    after = {1: ("replica", 1.5), 2: ("GCS", 2.2), 3: ("raylet", 0.1), 4: ("other", 9.0)}
    rows = fleet_cpu.shares(before, after, 10.0)
    assert [(r["process"], r["cpu_pct"]) for r in rows] == [
        ("replica", 5.0),
        ("GCS", 2.0),
        ("raylet", 1.0),
        ("all but the replicas", 3.0),
    ]
