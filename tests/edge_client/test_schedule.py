"""The outcome cache (speculation.schedule and the core's use of it): which outcomes get chains, how
deep, within the time left before the verdict is due."""

from __future__ import annotations

import numpy as np
import pytest

from edge_client.speculation import DraftConditional, PrespecConfig, Request, TreeSpec
from edge_client.speculation.estimates import Learned
from edge_client.speculation.schedule import chain_gains, concave, plan_chains
from shared.messages import Mode
from shared.tree import ExpansionConfig
from tests.edge_client.fake_drafter import FakeDrafter
from tests.edge_client.scripted import Scripted

CPU_VERIFY = {1: 400.0, 4: 480.0, 8: 560.0, 16: 740.0, 32: 1100.0}
PROBS = [0.2, 0.1, 0.08, 0.05, 0.04, 0.03, 0.02, 0.01]


def _llama(n: int) -> float:
    return 85.0 + 4.0 * n  # one evaluation of n rows: the weights dominate


def test_gains_start_at_zero_and_grow_with_depth_while_tokens_pay() -> None:
    g = chain_gains(0.86, 8, 350.0, CPU_VERIFY)  # a miss: ~1400 ms a round for ~4 tokens
    assert g[0] == 0.0 and g.shape == (9,)
    assert g[1] == pytest.approx((1 + 0.86) * 350.0 - 400.0)
    assert np.all(np.diff(g)[:4] > 0)
    # where a token saves less than the verifier's cost of one more node, depth stops paying
    cheap = chain_gains(0.3, 8, 30.0, CPU_VERIFY)
    assert np.any(np.diff(cheap) < 0)


def test_the_concave_majorant_values_a_first_level_that_does_not_pay_alone() -> None:
    g = np.asarray([0.0, -28.0, 93.0, 194.0, 276.0])  # a depth-1 chain loses, depth 2 wins
    env = concave(g)
    assert np.all(env >= g - 1e-9) and env[0] == 0.0 and env[-1] == g[-1]
    assert np.all(np.diff(np.diff(env)) <= 1e-9)  # gains per level never grow
    assert env[1] > 0
    plan = plan_chains([0.3, 0.1], g, _llama, 1000.0)
    assert plan.depths[0] >= 2  # the chain is drafted deep enough to pay


def test_a_schedule_fits_the_time_and_prefers_likely_outcomes() -> None:
    g = chain_gains(0.86, 8, 350.0, CPU_VERIFY)
    for budget in (90.0, 200.0, 400.0, 800.0, 2000.0):
        plan = plan_chains(PROBS, g, _llama, budget)
        assert plan.ms <= budget + 1e-9
        assert plan.ms == pytest.approx(sum(_llama(r) for r in plan.rows))
        assert list(plan.rows) == sorted(plan.rows, reverse=True)  # rows never grow
        assert list(plan.depths) == sorted(plan.depths, reverse=True)  # likelier: at least as deep
        assert all(plan.depths[j] == sum(r > j for r in plan.rows) for j in range(len(PROBS)))
    small, large = plan_chains(PROBS, g, _llama, 200.0), plan_chains(PROBS, g, _llama, 2000.0)
    assert large.value > small.value and sum(large.depths) > sum(small.depths)
    # one evaluation is dear and rows are cheap: the first one covers several outcomes at once
    assert small.rows and small.rows[0] > 1
    assert plan_chains(PROBS, g, _llama, 50.0).rows == ()  # not even one evaluation fits
    assert plan_chains([], g, _llama, 500.0).depths == ()


def test_the_plan_is_the_best_within_the_budget_on_a_small_case() -> None:
    """Against every non-increasing rows list of up to 4 evaluations over 3 outcomes."""
    probs = [0.3, 0.15, 0.05]
    g = chain_gains(0.8, 4, 150.0, CPU_VERIFY)
    dg = np.diff(g)
    budget = 300.0
    best = 0.0
    import itertools

    for length in range(0, 5):
        for rows in itertools.product(range(1, 4), repeat=length):
            if list(rows) != sorted(rows, reverse=True):
                continue
            if sum(_llama(r) for r in rows) > budget:
                continue
            best = max(best, sum(dg[level] * sum(probs[:r]) for level, r in enumerate(rows)))
    plan = plan_chains(probs, g, _llama, budget)
    assert plan.value >= 0.9 * best  # the Lagrangian may leave a little on the table, not more


def test_outcomes_must_come_most_likely_first() -> None:
    with pytest.raises(ValueError, match="most likely first"):
        plan_chains([0.1, 0.2], chain_gains(0.8, 4, 100.0, CPU_VERIFY), _llama, 500.0)


def test_the_core_drafts_the_likeliest_outcome_alone_then_chains_within_the_time_left() -> None:
    """A slow drafter (85 ms an evaluation, a tree 85 ms on the scripted clock), a 1 s round trip: the first
    conditional tree has the configured shape and is alone; the next outcomes come as chains in
    lockstep, likelier ones at least as deep, and drafting stops when no chain fits before the
    verdict is due."""
    main = TreeSpec("static", ExpansionConfig((2, 1, 1, 1)))
    s = Scripted(
        FakeDrafter(64),
        Request(Mode.GREEDY, main),
        PrespecConfig(fanout=3, max_chain=1, gate=True, cache=True, outcomes=12),
        eval_ms=_llama,
        verify_cost_ms=CPU_VERIFY,
        draft_ms=85.0,
    )
    s.learned.rtt_ms = 1000.0
    s.start([3, 14, 15, 9, 26, 5])
    s.idle()
    cond = s.draft_actions(DraftConditional)
    assert cond[0].shapes is None and len(cond[0].fulls) == 1  # the likeliest outcome, alone
    chains = [a for a in cond[1:] if a.shapes is not None]
    assert chains, "further outcomes get chains"
    first = chains[0]
    assert first.lockstep and len(first.fulls) == len(first.shapes or ()) >= 2
    depths = [sh.chain_depth for sh in first.shapes or ()]
    assert depths == sorted(depths, reverse=True) and depths[0] >= 1
    sent = s.sent_trees()
    chain_trees = [t.tree for t in sent[1:]]
    assert any(t.num_nodes == t.max_depth for t in chain_trees)  # chains were sent
    due = s.core.est.verdict_due
    assert due is not None
    # the chains were planned to end before the verdict is due (each drafted tree costs 85 ms here,
    # which the plan does not know: it may overrun by those, never start past the due time)
    assert s.core.idle(quiet=True) is None


def _first_chain_plan_ms(overrun: float, rtt_ms: float = 300.0) -> tuple[float, float]:
    """The priced time of the first chains the cache plans (rows per evaluation from their depths),
    and the time from the first send to when the verdict is due, with a drafter that takes no time."""
    s = Scripted(
        FakeDrafter(64),
        Request(Mode.GREEDY, TreeSpec("static", ExpansionConfig((2, 1, 1, 1)))),
        PrespecConfig(fanout=3, max_chain=1, gate=True, cache=True, outcomes=12),
        eval_ms=_llama,
        verify_cost_ms={1: 200.0, 8: 270.0, 32: 400.0},  # shorter than the chains the cache would like
    )
    s.learned.rtt_ms = rtt_ms
    s.learned.cache_overrun = overrun
    s.start([3, 14, 15, 9, 26, 5])
    chains: list[DraftConditional] = []
    for _ in range(4):  # the likeliest outcome's tree, then the first chains
        steps = s.core.idle(quiet=True)
        assert steps is not None
        s._run(steps)
        chains = [a for a in s.draft_actions(DraftConditional) if a.shapes is not None]
        if chains:
            break
    assert chains, "further outcomes get chains"
    assert chains[0].shapes is not None
    depths = [sh.chain_depth for sh in chains[0].shapes]
    rows = [sum(d > level for d in depths) for level in range(max(depths))]
    due = s.core.est.verdict_due
    assert due is not None
    return sum(_llama(r) for r in rows), (due - s.clock()) * 1e3


def test_the_chains_are_planned_to_reach_the_server_before_its_verdict_leaves() -> None:
    """The verdict is due here one round trip (300 ms) plus a verification (270 ms) after the tree
    went out; a chain sent later than a round trip before that reaches the server after its verdict
    and waits to be verified. So the chains get the verification's time, not the whole wait: they
    stay within it, and a longer round trip gives them no more time."""
    planned, left = _first_chain_plan_ms(1.0)
    window = left - 300.0
    assert window == pytest.approx(270.0)  # the advertised verification of the 8-node tree in flight
    assert window - _llama(12) <= planned <= window
    far, far_left = _first_chain_plan_ms(1.0, rtt_ms=900.0)
    assert far_left == pytest.approx(left + 600.0) and far == planned


def test_chains_that_took_longer_than_priced_shorten_the_next_plans() -> None:
    """The measured overrun (drafting took twice the priced time) halves the time planned; the
    overrun learns a quarter of the way to each ratio, never below 1 and at most 4."""
    planned, left = _first_chain_plan_ms(2.0)
    assert planned <= (left - 300.0) / 2
    learned = Learned()
    learned.observe_cache_plan(100.0, 300.0)
    assert learned.cache_overrun == pytest.approx(1.5)
    learned.observe_cache_plan(100.0, 50.0)  # faster than priced: counts as on time
    assert learned.cache_overrun == pytest.approx(1.375)
    learned.observe_cache_plan(0.0, 500.0)  # nothing priced: nothing learned
    assert learned.cache_overrun == pytest.approx(1.375)
    for _ in range(60):
        learned.observe_cache_plan(10.0, 1000.0)
    assert learned.cache_overrun == pytest.approx(4.0)


def _chains_planned(s: Scripted, steps: int = 6) -> list[DraftConditional]:
    """The lockstep chains the session's outcome cache drafts in its first `steps` idle steps."""
    for _ in range(steps):
        work = s.core.idle(quiet=True)
        if work is None:
            break
        s._run(work)
    return [a for a in s.draft_actions(DraftConditional) if a.shapes is not None]


def test_a_client_plans_with_its_own_measurements_never_another_clients() -> None:
    """Two clients (each its own Learned) share one drafter. What the drafter went through before
    the second client came (here its evaluations at 1e9 ms each and as much again per row of a
    builder's own work, as an earlier client on a machine stalled by other work would have
    measured them) never prices the second client's plans: before it drafts, it knows no cost (as
    with a new drafter); afterwards, only its own evaluations. With a verification of 270 s to
    draft in, its outcome cache plans chains; priced by the earlier figures none would fit."""
    drafter = FakeDrafter(64)
    cfg = PrespecConfig(fanout=3, max_chain=1, gate=True, cache=True, outcomes=12)
    req = Request(Mode.GREEDY, TreeSpec("static", ExpansionConfig((2, 1, 1, 1))))
    slow_verify = {1: 2e5, 8: 2.7e5, 32: 4e5}  # the verification above, a thousand times slower
    first = Scripted(drafter, req, cfg, verify_cost_ms=slow_verify)
    first.start([3, 14, 15, 9, 26, 5])
    first_evals = drafter.stats.extend_calls
    assert first_evals > 0 and first.step.eval_ms(1) is not None
    for rows in range(1, 65):
        drafter.stats.observe(rows, 1e9)
    drafter.stats.host_ms_per_row = 1e9

    second = Scripted(drafter, req, cfg, verify_cost_ms=slow_verify)
    assert second.step.eval_ms(1) is None and second.step.ms_per_node() == 0.0
    second.start([3, 14, 15, 9, 26, 5])
    chains = _chains_planned(second)
    assert chains, "the second client's own costs leave time for chains"
    own = second.learned.drafter_costs(1)[0]
    assert own is not first.learned.drafter_costs(1)[0]
    assert own.by_rows and max(own.by_rows.values()) < 1e9 and (own.host_ms_per_row or 0.0) < 1e9
    # the drafter's own counters (benches read them) still count both clients' evaluations
    assert drafter.stats.extend_calls == first_evals + own.extend_calls
