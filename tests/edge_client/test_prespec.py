"""Pre-speculation: outcome prediction, Saguaro's fan-out, and exactness with it on and off against a
live verifier (the core's bookkeeping alone: tests/edge_client/test_speculation.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import pytest

from bench.harness import load_prompts
from bench.lib.shaper import LinkShape
from edge_client.client import EdgeClient, PrespecConfig, TreeSpec
from edge_client.drafters.base import Drafter
from edge_client.drafters.registry import create_drafter
from edge_client.speculation.estimates import ChoiceModel
from edge_client.speculation.outcomes import (
    geometric_fanout,
    predict_outcomes,
    replay,
    worth_drafting,
)
from edge_client.stats import GenerationStats
from edge_client.trees import DraftOptions, draft_static
from shared.tree import ExpansionConfig, TokenTree
from shared.tree_match import rebase
from tests.cloud_verifier.service import LiveServer, slow_forwards, tiny
from tests.edge_client.fake_drafter import FakeDrafter

if TYPE_CHECKING:
    import torch


def test_geometric_fanout_is_capped_and_decays() -> None:
    p = [0.5, 0.25, 0.125, 0.0625]
    f = geometric_fanout(p, [10, 10, 10, 10], 8, r=1.0)
    assert sum(f) == 8
    assert f == sorted(f, reverse=True)  # more guesses where an outcome is likely
    # F_k proportional to P(k)^(1/2): ratios of sqrt(2) between neighbours
    assert f[0] >= f[1] >= f[2] >= 1
    capped = geometric_fanout(p, [1, 10, 10, 10], 8, r=1.0)
    assert capped[0] == 1 and sum(capped) == 8  # the capacity depth 0 cannot use goes elsewhere
    assert geometric_fanout(p, [1, 1, 0, 0], 8) == [1, 1, 0, 0]


def test_predicted_outcomes_are_real_continuations() -> None:
    d = FakeDrafter(64)
    committed = [1, 2, 3]
    dr = draft_static(d, committed, ExpansionConfig((1, 2, 1)), DraftOptions(eval_leaves=True))
    model = ChoiceModel(temperature=0.0)
    outs = predict_outcomes(dr, 6, model=model, allocation="top")
    assert len(outs) == 6
    probs = [o.prob for o in outs]
    assert probs == sorted(probs, reverse=True) and 0 < sum(probs) <= 1.0 + 1e-9
    tree = dr.tree
    for o in outs:
        path = tree.path_tokens(o.node) if o.node >= 0 else []
        assert list(o.cond) == [*path, o.bonus] and o.depth == len(path)
        kids = {int(tree.tokens[c]) for c in tree.children_of(o.node)}
        assert o.bonus not in kids  # a drafted child would have been accepted, not a bonus
    # greedy: with alpha high, the most likely outcome accepts the whole top chain
    confident = ChoiceModel(temperature=0.0, agree=99.0, tested=100.0)
    best = predict_outcomes(dr, 1, model=confident, allocation="top")[0]
    assert best.depth == tree.max_depth
    assert best.bonus == int(dr.alt_tokens[best.node + 1][0])  # the draft's top token after the leaf
    geo = predict_outcomes(dr, 6, model=model)
    assert len(geo) == 6 and len({(o.node, o.bonus) for o in geo}) == 6
    # uniform: as many outcomes at every accepted length (0..3 here), the likeliest of each
    uni = predict_outcomes(dr, 8, model=confident, allocation="uniform")
    by_depth = [sum(o.depth == k for o in uni) for k in range(tree.max_depth + 1)]
    assert by_depth == [2] * (tree.max_depth + 1)
    top = predict_outcomes(dr, 8, model=confident, allocation="top")
    # the likeliest 8 cover at least as much probability as any other 8
    assert sum(o.prob for o in top) >= sum(o.prob for o in uni) - 1e-12
    assert [sum(o.depth == k for o in top) for k in range(tree.max_depth + 1)] != by_depth
    with pytest.raises(ValueError, match="uniform"):
        predict_outcomes(dr, 4, model=model, allocation="best")


def test_choice_model_learns_agreement() -> None:
    d = FakeDrafter(64)
    dr = draft_static(d, [5, 6], ExpansionConfig((1, 1)), DraftOptions(eval_leaves=True))
    m = ChoiceModel(temperature=0.0)
    a0 = m.alpha
    top = [int(dr.alt_tokens[0][0]), int(dr.alt_tokens[1][0]), int(dr.alt_tokens[2][0])]
    for _ in range(20):
        m.observe(dr, [0, 1], top)  # the target always agreed with the draft's top token
    assert m.alpha > a0
    for _ in range(40):
        m.observe(dr, [], [(top[0] + 1) % 64])  # ... then never
    assert m.alpha < a0


def test_choice_model_calibrates_the_runners_up() -> None:
    """A weak draft's runners-up can carry much of its mass and still rarely hold the target's
    token: the learned calibration beta scales their predicted shares to what is observed."""
    d = FakeDrafter(64)
    dr = draft_static(d, [5, 6], ExpansionConfig((1, 1)), DraftOptions(eval_leaves=True))
    alts, q = dr.alt_tokens[0], dr.alt_probs[0]
    outside = next(t for t in range(64) if t not in set(alts.tolist()))
    m = ChoiceModel(temperature=0.0)
    before = sum(p for t, p in m.choice(alts, q, False).items() if t != int(alts[0]))
    assert m.beta == 1.0 and before > 0.05
    for _ in range(60):
        m.observe(dr, [], [outside])  # the target's token is never among the draft's alternatives
    uncalibrated = dataclasses.replace(m, alt_hits=2.0, alt_predicted=2.0)  # same alpha, beta 1
    after = sum(p for t, p in m.choice(alts, q, False).items() if t != int(alts[0]))
    plain = sum(p for t, p in uncalibrated.choice(alts, q, False).items() if t != int(alts[0]))
    assert m.beta < 0.1 and after == pytest.approx(m.beta * plain)
    # predicted outcomes follow: the bonus candidates after row 0 lose their odds
    odds = {(o.node, o.bonus): o.prob for o in predict_outcomes(dr, 8, model=uncalibrated, allocation="top")}
    for o in predict_outcomes(dr, 8, model=m, allocation="top"):
        if o.node < 0:
            assert o.prob == pytest.approx(m.beta * odds[(o.node, o.bonus)])
    # ... and a draft whose runner-up always holds the target's token earns them back, capped so
    # that the shares never exceed the mass left by the top token
    good = ChoiceModel(temperature=0.0)
    for _ in range(60):
        good.observe(dr, [], [int(alts[1])])
    shares = good.choice(alts, q, False)
    assert good.beta > 1.0
    assert sum(shares.values()) <= 1.0 + 1e-9
    assert sum(p for t, p in shares.items() if t != int(alts[0])) <= 1.0 - good.alpha + 1e-9


def test_rebase_and_replay() -> None:
    t = TokenTree.build([7, 8], [-1, 0], base=3, cond=[4, 5])
    r = rebase(t, 4)
    assert r.base == 4 and r.cond.tolist() == [5] and r.positions.tolist() == t.positions.tolist()
    with pytest.raises(ValueError):
        rebase(t, 6)
    d = FakeDrafter(64)
    dr = draft_static(d, [1, 2], ExpansionConfig((2, 1)))
    d.sync([1, 2])  # drops the workspace
    ids = replay(d, dr.tree)
    assert [d.node_token(i) for i in ids] == dr.tree.tokens.tolist()
    assert [d.node_parent(i) for i in ids] == [-1 if p < 0 else ids[p] for p in dr.tree.parents.tolist()]
    assert replay(d, dr.tree) == ids  # nodes already present are reused


def _run(
    url: str, drafter: Drafter, prompt: str, prespec: bool | PrespecConfig, rtt: float = 30.0, **kw: Any
) -> tuple[list[int], GenerationStats]:
    async def go() -> tuple[list[int], GenerationStats]:
        cfg: PrespecConfig | bool = prespec
        if prespec is True:
            cfg = PrespecConfig(fanout=3)
        async with EdgeClient(url, drafter, prespec=cfg, link=LinkShape.rtt(rtt), tree=TreeSpec()) as c:
            async for _ in c.generate(prompt, **kw):
                pass
            assert c.last is not None
            return c.last.tokens, c.last.stats

    return asyncio.run(go())


def test_prespec_on_and_off_give_the_same_tokens() -> None:
    """Greedy and seeded match: identical output with pre-speculation on and off, and the
    conditional trees really hit (the self-draft predicts its own outcomes well)."""
    prompts = [p.text for p in load_prompts(2)]
    drafter = create_drafter("torch", "tiny")
    with LiveServer(max_pending=6) as srv:
        for p in prompts:
            off, _ = _run(srv.ws, drafter, p, False, max_new_tokens=40)
            on, st = _run(srv.ws, drafter, p, True, max_new_tokens=40)
            assert on == off
            assert st.prespec_sent > 0 and st.hits > 0
            # the outcome model's own odds for what it drafted are recorded beside the hits
            assert st.predicted_hit_rate is not None and 0.0 < st.predicted_hit_rate <= 1.0
            m_off, _ = _run(
                srv.ws, drafter, p, False, max_new_tokens=24, mode="match", temperature=0.8, seed=4
            )
            m_on, _ = _run(srv.ws, drafter, p, True, max_new_tokens=24, mode="match", temperature=0.8, seed=4)
            assert m_on == m_off


@pytest.mark.parametrize("mode", ["mss", "rrs"])
def test_prespec_in_stochastic_modes_keeps_draws_valid(mode: str) -> None:
    """Conditional trees in mss/rrs carry draws from q at their own assumed prefix; the verifier
    validates every one (a bad draw would be an error frame and fail the generation). The cost gate
    is off: under CPU load its first-round estimate can hold back every conditional tree, and what
    is tested here is the draws of the trees sent, not the gate."""
    drafter = create_drafter("torch", "tiny")
    with LiveServer(trust_anonymous=True, max_pending=6) as srv:
        # a long round trip: conditional trees leave before the verdict comes back
        toks, st = _run(
            srv.ws,
            drafter,
            "Once upon a time",
            PrespecConfig(fanout=3, gate=False),
            rtt=1000.0,
            max_new_tokens=24,
            mode=mode,
            temperature=1.0,
            seed=2,
        )
        assert len(toks) == 24 or toks[-1] == 2
        assert st.prespec_sent > 0


def test_misses_and_stales_end_to_end() -> None:
    """A draft whose rankings are scrambled: its conditional trees mostly miss, come back stale,
    and the client falls back to drafting synchronously; the output is still exactly the target's."""
    from tests.edge_client.test_e2e import compare, greedy_with_gaps

    drafter = create_drafter("torch", "tiny")
    rng = np.random.default_rng(0)
    evaluate = drafter._evaluate

    def noisy(first: int, count: int) -> np.ndarray:
        out = np.array(evaluate(first, count))
        return out + rng.normal(0, 50.0, out.shape).astype(np.float32)  # scramble the ranking

    cast(Any, drafter)._evaluate = noisy
    p = load_prompts(1)[0].text
    tok = drafter.tokenizer
    prompt_tokens = tok.encode(tok.render_chat([{"role": "user", "content": p}]), add_special=False)
    with LiveServer(max_pending=6) as srv:
        toks, st = _run(srv.ws, drafter, p, True, rtt=300.0, max_new_tokens=16)
        stale = srv.app.state.verifier.metrics.cond_stale._value.get()
    ref, gaps = greedy_with_gaps(tiny(), prompt_tokens, 16)
    compare(toks, ref, gaps)
    assert st.prespec_sent > 0 and st.hit_rate is not None and st.hit_rate < 0.5
    assert stale > 0


def test_cost_gate_weighs_the_saving_against_the_delayed_fallback() -> None:
    # a likely outcome: drafting it saves a whole draft on the critical path
    assert worth_drafting(0.8, 0.2, draft_ms=200.0, rtt_ms=0.0, time_left_ms=35.0)
    # an unlikely one with the verdict about to arrive: the fallback would wait for it
    assert not worth_drafting(0.2, 0.8, draft_ms=200.0, rtt_ms=0.0, time_left_ms=35.0)
    # the same outcome pays off when the round trip it saves is long
    assert worth_drafting(0.2, 0.8, draft_ms=200.0, rtt_ms=500.0, time_left_ms=35.0)
    # a draft that ends before the verdict arrives costs nothing on the critical path
    assert worth_drafting(0.01, 1.0, draft_ms=50.0, rtt_ms=0.0, time_left_ms=80.0)
    # nothing to gain: never worth a delay
    assert not worth_drafting(0.0, 1.0, draft_ms=50.0, rtt_ms=0.0, time_left_ms=10.0)
    # a draft abandoned between evaluations delays a fallback by at most one evaluation
    assert worth_drafting(0.2, 0.8, draft_ms=200.0, rtt_ms=0.0, time_left_ms=35.0, step_ms=25.0)
    assert not worth_drafting(0.05, 0.95, draft_ms=200.0, rtt_ms=0.0, time_left_ms=35.0, step_ms=25.0)
    assert not worth_drafting(0.0, 1.0, draft_ms=200.0, rtt_ms=0.0, time_left_ms=0.0, step_ms=1.0)
    # a floor on the saving per drafting ms holds back a free but rarely used tree
    assert not worth_drafting(0.01, 1.0, draft_ms=50.0, rtt_ms=0.0, time_left_ms=80.0, min_gain=0.1)
    assert worth_drafting(0.5, 1.0, draft_ms=50.0, rtt_ms=0.0, time_left_ms=80.0, min_gain=0.1)
    with pytest.raises(ValueError, match="p_hit"):
        worth_drafting(1.5, 0.2, draft_ms=1.0, rtt_ms=0.0, time_left_ms=0.0)
    with pytest.raises(ValueError, match="p_fallback"):
        worth_drafting(0.5, -0.1, draft_ms=1.0, rtt_ms=0.0, time_left_ms=0.0)


def test_cost_gate_holds_back_unlikely_trees_on_a_slow_drafter() -> None:
    """A slow drafter with scrambled rankings: the gate holds back conditional trees that are
    unlikely to hit, a draft whose outcome a verdict rules out is abandoned mid-way, and the
    output is the same either way."""
    import time

    drafter = create_drafter("torch", "tiny")
    rng = np.random.default_rng(1)
    evaluate = drafter._evaluate

    def slow_noisy(first: int, count: int) -> np.ndarray:
        time.sleep(0.02)
        out = np.array(evaluate(first, count))
        return out + rng.normal(0, 50.0, out.shape).astype(np.float32)

    cast(Any, drafter)._evaluate = slow_noisy
    p = load_prompts(1)[0].text
    with LiveServer(max_pending=6) as srv:
        gated, st_g = _run(srv.ws, drafter, p, PrespecConfig(fanout=3), rtt=100.0, max_new_tokens=32)
        free, st_f = _run(
            srv.ws, drafter, p, PrespecConfig(fanout=3, gate=False), rtt=100.0, max_new_tokens=32
        )
    assert gated == free
    assert st_g.prespec_gated > 0 and st_f.prespec_gated == 0
    # drafts a verdict overtakes are abandoned, not finished
    assert st_f.prespec_cancelled > 0


def test_a_conditional_tree_refused_for_room_is_dropped() -> None:
    """A client that believes the server keeps more pending trees than it does (here: told 6, the
    server keeps 1) gets TOO_MANY_PENDING for the extra conditional trees: they are dropped like
    stale ones and the generation finishes with exactly the target's tokens."""
    import dataclasses

    from tests.edge_client.test_e2e import compare, greedy_with_gaps

    drafter = create_drafter("torch", "tiny")
    rng = np.random.default_rng(2)
    evaluate = drafter._evaluate

    def noisy(first: int, count: int) -> np.ndarray:  # outcomes worth several guesses
        out = np.array(evaluate(first, count))
        return out + rng.normal(0, 3.0, out.shape).astype(np.float32)

    cast(Any, drafter)._evaluate = noisy
    tok = drafter.tokenizer
    p = load_prompts(1)[0].text
    prompt_tokens = tok.encode(tok.render_chat([{"role": "user", "content": p}]), add_special=False)

    small = TreeSpec("static", ExpansionConfig((2, 1)))

    async def go() -> tuple[list[int], GenerationStats]:
        cfg = PrespecConfig(fanout=3, gate=False)
        async with EdgeClient(srv.ws, drafter, prespec=cfg, link=LinkShape.rtt(20.0), tree=small) as c:
            assert c.welcome is not None and c.welcome.limits.max_pending == 1
            told = dataclasses.replace(c.welcome, limits=dataclasses.replace(c.welcome.limits, max_pending=6))
            c.welcome = c.proto.welcome_msg = told
            async for _ in c.generate(p, max_new_tokens=24):
                pass
            assert c.last is not None
            return c.last.tokens, c.last.stats

    model = tiny().model
    forward = model.forward_packed

    def slow_forward(*args: Any, **kw: Any) -> list[torch.Tensor]:  # conditional trees arrive mid-verify
        time.sleep(0.4)
        return forward(*args, **kw)

    cast(Any, model).forward_packed = slow_forward
    try:
        with LiveServer(max_pending=1) as srv:
            toks, st = asyncio.run(go())
    finally:
        del model.forward_packed
    ref, gaps = greedy_with_gaps(tiny(), prompt_tokens, 24)
    compare(toks, ref, gaps)
    assert st.prespec_refused > 0


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("fanout", 0),
        ("max_chain", 0),
        ("byte_budget", -1),
        ("allocation", "random"),
        ("r", 0.0),
        ("min_gain", -0.1),
        ("leaf_min_reach", 1.5),
    ],
)
def test_prespec_config_names_the_bad_field(field: str, value: Any) -> None:
    with pytest.raises(ValueError, match=f"PrespecConfig.{field} must be"):
        PrespecConfig(**{field: value})
    PrespecConfig(min_gain=0.1, leaf_min_reach=0.0, allocation="top")  # in range: accepted


def test_clients_sharing_a_drafter_each_plan_with_their_own_measurements() -> None:
    """Two clients of one drafter, one after the other (as bench.end_to_end.e2e runs its modes): each prices
    its plans with what it measured itself (its Learned's drafter costs count exactly its own
    evaluations; the drafter's counters count both), and the first one's round trace leaves
    nothing switched on in the drafter (its log stays off for the next client)."""
    drafter = create_drafter("torch", "tiny")
    prompt = load_prompts(1)[0].text

    async def one(url: str, trace: bool) -> EdgeClient:
        cfg = PrespecConfig(fanout=3, gate=False)
        async with EdgeClient(
            url, drafter, prespec=cfg, link=LinkShape.rtt(20.0), tree=TreeSpec(), trace=trace
        ) as c:
            async for _ in c.generate(prompt, max_new_tokens=16):
                pass
        return c

    with LiveServer(max_pending=6) as srv:
        first = asyncio.run(one(srv.ws, True))
        assert drafter.stats.log is None
        second = asyncio.run(one(srv.ws, False))
    drafter.close()
    a, b = first.learned.drafter_costs(1)[0], second.learned.drafter_costs(1)[0]
    assert a.extend_calls > 0 and b.extend_calls > 0
    assert a.extend_calls + b.extend_calls == drafter.stats.extend_calls
    assert a.sync_calls + b.sync_calls == drafter.stats.sync_calls
    assert first.last is not None and first.last.stats.trace is not None
    assert any(e.evaluations for e in first.last.stats.trace.drafts)  # the trace still has them
    assert drafter.stats.log is None


def test_the_outcome_cache_and_the_priced_miss_path_keep_the_output(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the outcome cache on (chains for the further outcomes, planned to reach the server before
    its verdict) and the miss path forced to chains, greedy and seeded match give exactly the output
    of no pre-speculation; the cache's chains really go out and the misses really draft chains.

    The chains get the time of a verification (they must reach the server before its verdict
    leaves), which for `tiny` on a CPU is a few ms: no chain would fit. The verifier here takes
    300 ms a forward (a sleep, as the real pair's ~400-700 ms on this CPU), so every round has time
    for chains that no load on the machine takes away (the sleep uses no CPU)."""
    slow_forwards(monkeypatch, 0.3)
    prompt = load_prompts(1)[0].text
    drafter = create_drafter("torch", "tiny")

    async def traced(url: str, cfg: PrespecConfig, **kw: Any) -> tuple[list[int], GenerationStats]:
        async with EdgeClient(
            url, drafter, prespec=cfg, link=LinkShape.rtt(100.0), tree=TreeSpec(), trace=True
        ) as c:
            async for _ in c.generate(prompt, **kw):
                pass
            assert c.last is not None
            return c.last.tokens, c.last.stats

    cfg = PrespecConfig(fanout=3, gate=False, cache=True, backup="chain")
    with LiveServer(max_pending=32) as srv:
        runs: list[dict[str, Any]] = [{}, {"mode": "match", "temperature": 0.8, "seed": 4}]
        for kw in runs:
            off, _ = _run(srv.ws, drafter, prompt, False, max_new_tokens=32, **kw)
            on, st = asyncio.run(traced(srv.ws, cfg, max_new_tokens=32, **kw))
            assert on == off, kw
            assert st.trace is not None
            chains = [e for e in st.trace.sends if e.parent is not None and e.nodes == e.depth]
            if not kw:  # (seeded match here accepts whole trees in a few rounds: little time for chains)
                assert chains, "the outcome cache sent chains"
            misses = st.decided - st.hits
            assert sum(st.backups.values()) <= misses
            if misses:
                assert st.backups and all(k.startswith("chain") for k in st.backups)
