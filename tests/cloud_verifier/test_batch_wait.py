"""The batch wait (cloud_verifier/batch_wait.py): the rule on a CPU's and a flat (GPU) cost curve,
its bounds, the arrival predictor, and the engine recording each forward's wait for /metrics."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from bench.simulation.simulate import Curve, TracedGeneration
from bench.simulation.simulate_batch import CPU_CURVE, WaitPolicy, run_batch
from cloud_verifier.batch_wait import (
    FORWARD_FRACTION,
    Arrival,
    ArrivalPredictor,
    forward_ms,
    plan_wait,
    wait_bound_ms,
)
from cloud_verifier.engine import Engine
from cloud_verifier.metrics import Metrics
from cloud_verifier.step import EngineConfig, RoundResult, SeqState
from edge_client.stats import RoundTrace, SendEvent, VerdictEvent
from shared.messages import Mode, Prompt
from tests.cloud_verifier.service import prompt_tokens, tiny

# this CPU's forward (rows: ms) 1: 69, 4: 84, 8: 132, 16: 252, as the engine's curve {N nodes: ms}
CPU = {0: 69.0, 3: 84.0, 7: 132.0, 15: 252.0}
FLAT = {1: 16.0, 2: 16.0, 4: 16.0, 8: 16.0, 16: 16.0, 32: 16.0, 64: 16.0}


def test_forward_ms_reads_the_curve_by_rows() -> None:
    assert forward_ms({}, 5) is None
    assert forward_ms(CPU, 1) == 69.0 and forward_ms(CPU, 4) == 84.0 and forward_ms(CPU, 16) == 252.0
    assert forward_ms(CPU, 5) == pytest.approx(96.0)  # between 4 and 8 rows
    assert forward_ms(CPU, 24) == pytest.approx(252.0 + 15.0 * 8)  # the last slope beyond
    assert forward_ms(FLAT, 1) == 16.0 and forward_ms(FLAT, 500) == 16.0


@pytest.mark.parametrize("ready_sessions", [1, 2, 4])
@pytest.mark.parametrize("nodes", [4, 8, 16])
def test_the_cpu_curve_never_waits_for_tree_rounds(ready_sessions: int, nodes: int) -> None:
    rows = ready_sessions * (1 + nodes)
    bound = wait_bound_ms(CPU, rows, gather_ms=50.0)
    for in_ms in (0.0, 0.5, 1.0, 3.0, 10.0):
        arrivals = [Arrival(in_ms, 1 + nodes), Arrival(in_ms + 0.5, 1 + nodes)]
        assert plan_wait(CPU, rows, ready_sessions, arrivals, bound) == 0.0


def test_a_flat_curve_waits_for_a_session_due_within_a_few_ms() -> None:
    bound = wait_bound_ms(FLAT, 9, gather_ms=3.0)
    assert bound == 3.0
    assert plan_wait(FLAT, 9, 1, [Arrival(2.0, 9)], bound) == 2.0
    # the one whose gain is largest: the later arrival brings a second session for 0.5 ms more
    assert plan_wait(FLAT, 9, 1, [Arrival(1.0, 9), Arrival(1.5, 9)], bound) == 1.5
    # beyond the bound, overdue (no estimate) or nobody expected: go now
    assert plan_wait(FLAT, 9, 1, [Arrival(4.0, 9)], bound) == 0.0
    assert plan_wait(FLAT, 9, 1, [Arrival(-1.0, 9)], bound) == 0.0
    assert plan_wait(FLAT, 9, 1, [], bound) == 0.0
    # w < c * S_A / (S_A + S_R): many sessions ready make a short wait not pay
    assert plan_wait(FLAT, 8 * 9, 8, [Arrival(2.0, 9)], 8.0) == 0.0
    assert plan_wait(FLAT, 8 * 9, 8, [Arrival(1.5, 9)], 8.0) == 1.5  # 1.5 < 16 / 9


def test_the_wait_never_passes_gather_ms_nor_a_fraction_of_a_forward() -> None:
    assert wait_bound_ms(FLAT, 9, gather_ms=3.0) == 3.0
    assert wait_bound_ms(FLAT, 9, gather_ms=100.0) == FORWARD_FRACTION * 16.0
    assert wait_bound_ms(FLAT, 9, gather_ms=0.0) == 0.0
    assert wait_bound_ms({}, 9, gather_ms=3.0) == 0.0  # no curve: no wait
    for gather in (0.0, 1.0, 3.0, 20.0):
        bound = wait_bound_ms(FLAT, 9, gather)
        arrivals = [Arrival(x / 4, 9) for x in range(80)]
        w = plan_wait(FLAT, 9, 1, arrivals, bound)
        assert 0.0 <= w <= min(gather, FORWARD_FRACTION * 16.0)
    assert plan_wait({}, 9, 1, [Arrival(1.0, 9)], 3.0) == 0.0


def test_the_predictor_takes_the_median_of_a_sessions_gaps() -> None:
    p = ArrivalPredictor()
    assert p.expected(1, 0.0) is None
    for t, gap in ((0.0, 0.010), (1.0, 0.030), (2.0, 0.020)):
        p.verdict(1, t, 9)
        p.submitted(1, t + gap)
    assert p.expected(1, 3.0) is None  # not between rounds
    p.verdict(1, 3.0, 5)
    a = p.expected(1, 3.005)
    assert a is not None and a.in_ms == pytest.approx(15.0) and a.rows == 5
    p.idle(1)  # the generation ended: nothing expected, the gaps kept
    assert p.expected(1, 3.005) is None
    p.submitted(1, 9.0)  # a new generation's first round: no gap
    p.verdict(1, 10.0, 9)
    a = p.expected(1, 10.0)
    assert a is not None and a.in_ms == pytest.approx(20.0)
    p.forget(1)
    assert p.expected(1, 10.0) is None


def _run_staggered(cost_ms: dict[int, float], gaps_s: tuple[float, ...], rounds: int) -> Engine:
    """Sessions of 1-row rounds on the tiny model, each resubmitting its gap after every verdict
    (an edge's round trip and drafting), until each has had `rounds` verdicts."""
    t = tiny()
    e = Engine(t, t.new_kv_cache(256, 16), EngineConfig(gather_ms=10.0))
    e.cost_ms = cost_ms

    async def main() -> None:
        loop = asyncio.get_running_loop()
        left = len(gaps_s)
        done = asyncio.Event()
        e.start_loop()

        def cb(s: SeqState, gap: float) -> None:
            def on_result(r: RoundResult) -> None:
                nonlocal left
                if r.round + 1 >= rounds or r.done:
                    left -= 1
                    if left == 0:
                        done.set()
                    return
                loop.call_later(gap, e.submit, s, r.round + 1, None)

            s.on_result = on_result

        for i, gap in enumerate(gaps_s):
            s = e.open(lambda r: None)
            cb(s, gap)
            toks = np.asarray(prompt_tokens(40 + i, 4), dtype=np.int32)
            e.start(s, Prompt(toks, Mode.GREEDY, max_new_tokens=rounds + 4), toks)
        try:
            await asyncio.wait_for(done.wait(), 60.0)
        finally:
            await e.stop()

    asyncio.run(main())
    return e


def test_the_engine_waits_on_a_flat_curve_and_metrics_record_it() -> None:
    e = _run_staggered(FLAT, (0.001, 0.004), rounds=20)
    waits = list(e.batch_waits)
    assert len(waits) == e.steps
    assert e.waited_forwards >= 1 and max(waits) > 0
    assert max(waits) <= 0.010 * 1.5 + 0.05  # gather_ms, and the loop's own lateness at worst
    m = Metrics()
    m.record_pool(e)
    text = m.registry.get_sample_value("cloud_verifier_batch_wait_seconds_count")
    assert text == e.steps and not e.batch_waits  # drained
    assert m.registry.get_sample_value("cloud_verifier_batch_waited_forwards_total") == e.waited_forwards


def test_the_engine_does_not_wait_without_a_curve() -> None:
    e = _run_staggered({}, (0.001, 0.004), rounds=8)
    assert e.waited_forwards == 0 and len(e.batch_waits) == e.steps and not any(e.batch_waits)


def test_an_arrival_is_waited_for_until_its_spread_and_not_once_later() -> None:
    p = ArrivalPredictor()
    for t, gap in ((0.0, 0.010), (1.0, 0.012), (2.0, 0.014)):
        p.verdict(1, t, 9)
        p.submitted(1, t + gap)
    p.verdict(1, 3.0, 9)
    a = p.expected(1, 3.011)
    assert a is not None and a.in_ms == pytest.approx(1.0) and a.spread_ms == pytest.approx(2.0)
    assert plan_wait(FLAT, 9, 1, [a], 3.0) == pytest.approx(3.0)  # until 2 ms past its median gap
    late = p.expected(1, 3.0145)  # 1.5 ms past the median gap + its spread: not waited for
    assert late is not None and plan_wait(FLAT, 9, 1, [late], 3.0) == 0.0
    assert plan_wait(FLAT, 9, 1, [Arrival(0.01, 9)], 3.0) == 0.0  # as good as here


# ----------------------------------------------------------------------------- the simulator
def _misses(rounds: int, edge_s: float = 0.1, nodes: int = 8) -> TracedGeneration:
    """A generation of tree rounds that all miss: the edge drafts edge_s after each verdict."""
    sends, verdicts = [], []
    t = 0.0
    for j in range(rounds):
        sends.append(SendEvent(t, j, None, nodes, nodes, 0, 1.0, 100))
        t += 0.05
        verdicts.append(VerdictEvent(t, j, 3, 4, 50.0, False, None, j == rounds - 1))
        t += edge_s
    return TracedGeneration(RoundTrace(sends, verdicts, []), 4 * rounds, 40.0, "tree", 0.0)


def _edges() -> list[TracedGeneration]:
    """Steady edges, each drafting a little longer than the last (an edge as regular as a clock,
    arrivals predictable; all alike, the verifier's forwards would quantize them)."""
    return [_misses(12, edge_s=0.1 + 0.0037 * k) for k in range(7)]


def test_the_simulator_runs_the_rule_never_waiting_on_the_cpu_curve() -> None:
    gens = _edges()
    for clients in (1, 4, 16):
        off = run_batch(gens, CPU_CURVE, clients, WaitPolicy.parse("off"), rtt_ms=20.0)
        rule = run_batch(gens, CPU_CURVE, clients, WaitPolicy.parse("rule"), rtt_ms=20.0)
        assert rule["waited_forwards"] == 0 and rule == {**off, "batch_wait": "rule:3"}
        assert off["tokens"] == clients * 4 * 12 * 4  # 4 generations a client, 12 rounds of 4 tokens
    fixed = run_batch(gens, CPU_CURVE, 16, WaitPolicy.parse("fixed:3"), rtt_ms=20.0)
    assert fixed["waited_forwards"] > 0 and fixed["mean_wait_ms"] <= 3.0


def test_the_simulator_runs_the_rule_waiting_briefly_on_a_flat_curve() -> None:
    gens = _edges()
    off = run_batch(gens, Curve.flat(16.0), 16, WaitPolicy.parse("off"), rtt_ms=20.0)
    r = run_batch(gens, Curve.flat(16.0), 16, WaitPolicy.parse("rule"), rtt_ms=20.0)
    assert r["waited_forwards"] > 0 and 0 < r["mean_wait_ms"] <= 3.0
    # predictable edges: fuller forwards, the cloud's cost and the users' latency both lower
    assert r["sessions_per_forward"] > off["sessions_per_forward"]
    assert r["verifier_s_per_token"] < off["verifier_s_per_token"]
    assert r["user_ms_per_token"] < off["user_ms_per_token"]
    r8 = run_batch(gens, Curve.flat(16.0), 16, WaitPolicy.parse("rule:20"), rtt_ms=20.0)
    assert 0 < r8["mean_wait_ms"] <= 8.0  # half a forward, whatever gather_ms
    with pytest.raises(ValueError):
        WaitPolicy.parse("fixed")
    with pytest.raises(ValueError):
        WaitPolicy.parse("sometimes:3")
