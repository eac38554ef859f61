"""Conditional trees drafted in lockstep equal the trees drafted one by one, in fewer evaluations,
and every shape and mode pre-speculates in lockstep end to end."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from bench.lib.shaper import LinkShape
from edge_client.client import EdgeClient, PrespecConfig, TreeSpec
from edge_client.drafters import WorkspaceFullError
from edge_client.drafters.registry import create_drafter
from edge_client.stats import GenerationStats
from edge_client.trees import (
    Coupling,
    DraftCancelled,
    DraftOptions,
    DraftResult,
    Sampling,
    draft_dynamic,
    draft_dynamic_many,
    draft_static,
    draft_static_many,
    finish_leaves,
    finish_leaves_many,
)
from shared.messages import Mode
from shared.tree import ExpansionConfig
from tests.cloud_verifier.service import LiveServer
from tests.edge_client.fake_drafter import FakeDrafter

V = 64
S = [3, 14, 15, 9, 26, 5]


def _outcome_conds(d: FakeDrafter) -> list[tuple[int, ...]]:
    """A tree in flight and three outcomes of it: full acceptance with the draft's bonus, a
    rejection at depth 1 with a second-choice bonus, and one at the root."""
    first = draft_static(d, S, ExpansionConfig((1, 1, 1)), DraftOptions(eval_leaves=True))
    leaf = first.tree.leaves()[0]
    path = first.tree.path_tokens(leaf)
    return [
        (*path, int(first.alt_tokens[leaf + 1, 0])),
        (path[0], int(first.alt_tokens[1, 1])),
        (int(first.alt_tokens[0, 1]),),
    ]


@pytest.mark.parametrize("config", [(1, 1, 1, 1), (2, 1, 1), (1, 3, 1)])
@pytest.mark.parametrize("mode", ["greedy", "match"])
def test_lockstep_trees_equal_trees_drafted_alone(config: tuple[int, ...], mode: str) -> None:
    cfg = ExpansionConfig(config)
    coupling = Coupling(seed=7, temperature=0.8) if mode == "match" else None
    alone_d, many_d = FakeDrafter(V), FakeDrafter(V)
    conds = _outcome_conds(alone_d)
    assert _outcome_conds(many_d) == conds
    alone = [
        draft_static(
            alone_d, S, cfg, DraftOptions(cond=c, reuse_workspace=True, mode=mode, coupling=coupling)
        )
        for c in conds
    ]
    calls = many_d.stats.extend_calls
    many = draft_static_many(many_d, S, cfg, conds, DraftOptions(mode=mode, coupling=coupling))
    # one evaluation for the bonus chains, then one per evaluated level (not one per tree)
    assert many_d.stats.extend_calls - calls == 1 + cfg.depth - 1
    for a, b in zip(alone, many, strict=True):
        assert b is not None
        assert np.array_equal(a.tree.tokens, b.tree.tokens) and np.array_equal(a.tree.parents, b.tree.parents)
        assert a.tree.base == b.tree.base and np.array_equal(a.tree.cond, b.tree.cond)
        assert np.allclose(a.path_prob, b.path_prob) and np.array_equal(a.alt_tokens, b.alt_tokens)
        assert many_d.path_to(b.root_id)  # hangs below its cond in the workspace
    # the leaves of all of them in one evaluation, as finish_leaves gives them one by one
    calls = many_d.stats.extend_calls
    done = finish_leaves_many(
        many_d, [(b, None) for b in many if b is not None], DraftOptions(mode=mode, coupling=coupling)
    )
    assert many_d.stats.extend_calls - calls == 1
    for a, b in zip(alone, done, strict=True):
        ref = finish_leaves(alone_d, a, DraftOptions(mode=mode, coupling=coupling))
        assert np.array_equal(ref.alt_tokens, b.alt_tokens) and bool((b.workspace_ids >= 0).all())


def test_a_stopped_tree_is_dropped_and_the_others_go_on() -> None:
    d = FakeDrafter(V)
    conds = _outcome_conds(d)
    asked = [0]

    def second_gone() -> bool:
        asked[0] += 1
        return asked[0] >= 2  # wanted for the first level only

    out = draft_static_many(d, S, ExpansionConfig((1, 1, 1)), conds, stops=[None, second_gone, None])
    assert out[0] is not None and out[1] is None and out[2] is not None
    with pytest.raises(DraftCancelled):
        draft_static_many(d, S, ExpansionConfig((1, 1)), conds, stops=[lambda: True] * 3)


def test_refusals() -> None:
    d = FakeDrafter(V, max_nodes=12)
    conds = _outcome_conds(d)
    held = d.num_nodes
    with pytest.raises(WorkspaceFullError):
        draft_static_many(d, S, ExpansionConfig((1, 1, 1, 1)), conds)
    assert d.num_nodes == held  # nothing added
    with pytest.raises(ValueError, match="samples"):
        draft_static_many(d, S, ExpansionConfig((1,)), conds, DraftOptions(mode=Mode.MSS))
    with pytest.raises(ValueError, match="greedy/match"):
        draft_dynamic_many(d, S, 4, conds, DraftOptions(mode=Mode.RRS))
    with pytest.raises(WorkspaceFullError, match="lower the budget"):
        draft_dynamic_many(d, S, 4, conds)
    assert d.num_nodes == held
    with pytest.raises(ValueError, match="synced"):
        draft_static_many(d, S[:-1], ExpansionConfig((1,)), conds)


def _same_tree(a: DraftResult, b: DraftResult | None) -> None:
    assert b is not None
    assert np.array_equal(a.tree.tokens, b.tree.tokens) and np.array_equal(a.tree.parents, b.tree.parents)
    assert np.array_equal(a.tree.cond, b.tree.cond) and np.allclose(a.path_prob, b.path_prob)
    assert np.array_equal(a.alt_tokens, b.alt_tokens)


@pytest.mark.parametrize("mode", ["mss", "rrs"])
def test_sampled_lockstep_trees_equal_trees_drafted_alone_with_the_same_generators(mode: str) -> None:
    """mss / rrs trees in lockstep: tree i draws with the i-th generator spawned from opts.rng, so it
    equals draft_static with that generator, draws and shipped q rows included; one evaluation per
    level for all of them."""
    cfg, sampling = ExpansionConfig((2, 2, 1)), Sampling(temperature=1.3, wire_top_k=16)
    alone_d, many_d = FakeDrafter(V), FakeDrafter(V)
    conds = _outcome_conds(alone_d)
    assert _outcome_conds(many_d) == conds
    gens = np.random.default_rng(11).spawn(len(conds))
    alone = [
        draft_static(
            alone_d,
            S,
            cfg,
            DraftOptions(mode=mode, sampling=sampling, rng=g, cond=c, reuse_workspace=True),
        )
        for c, g in zip(conds, gens, strict=True)
    ]
    calls = many_d.stats.extend_calls
    opts = DraftOptions(mode=mode, sampling=sampling, rng=np.random.default_rng(11))
    many = draft_static_many(many_d, S, cfg, conds, opts)
    assert many_d.stats.extend_calls - calls == 1 + cfg.depth - 1
    for a, b in zip(alone, many, strict=True):
        _same_tree(a, b)
        assert b is not None and a.tree.draws is not None and b.tree.draws is not None
        assert np.array_equal(a.tree.draws.node, b.tree.draws.node)
        assert np.array_equal(a.tree.draws.qrow, b.tree.draws.qrow)
        qa, qb = a.tree.draws.q, b.tree.draws.q
        assert all(np.array_equal(getattr(qa, f), getattr(qb, f)) for f in ("ptr", "ids", "weights"))
    # different generators: the batch's trees are not copies of one another
    assert len({tuple(b.tree.tokens.tolist()) for b in many if b is not None}) > 1


@pytest.mark.parametrize("mode", ["greedy", "match"])
def test_dynamic_lockstep_trees_equal_dynamic_trees_drafted_alone(mode: str) -> None:
    """Budget trees in lockstep grow as each would alone (same nodes, order, alternatives and
    frontier), with every round's batches of all of them in one evaluation: fewer evaluations
    than drafting them one by one."""
    coupling = Coupling(seed=3, temperature=0.9) if mode == "match" else None
    alone_d, many_d = FakeDrafter(V, max_nodes=256), FakeDrafter(V, max_nodes=256)
    conds = _outcome_conds(alone_d)
    assert _outcome_conds(many_d) == conds
    alone = []
    calls = alone_d.stats.extend_calls
    for c in conds:
        opts = DraftOptions(mode=mode, coupling=coupling, cond=c, reuse_workspace=True)
        alone.append(draft_dynamic(alone_d, S, 12, opts, max_depth=6, width=4))
    alone_calls = alone_d.stats.extend_calls - calls
    calls = many_d.stats.extend_calls
    many = draft_dynamic_many(
        many_d, S, 12, conds, DraftOptions(mode=mode, coupling=coupling), max_depth=6, width=4
    )
    many_calls = many_d.stats.extend_calls - calls
    for a, b in zip(alone, many, strict=True):
        _same_tree(a, b)
        assert b is not None and np.allclose(a.frontier_probs, b.frontier_probs)
        assert a.tree.num_nodes == 12 and many_d.path_to(b.root_id)
    assert many_calls < alone_calls
    assert many_calls <= 1 + max(a.evaluations for a in alone)


def test_a_stopped_dynamic_tree_is_dropped_and_the_others_go_on() -> None:
    d = FakeDrafter(V, max_nodes=256)
    conds = _outcome_conds(d)
    asked = [0]

    def first_gone() -> bool:
        asked[0] += 1
        return asked[0] >= 2

    out = draft_dynamic_many(d, S, 10, conds, stops=[first_gone, None, None], width=2)
    assert out[0] is None and out[1] is not None and out[2] is not None
    assert out[1].tree.num_nodes == 10
    with pytest.raises(DraftCancelled):
        draft_dynamic_many(d, S, 6, conds, stops=[lambda: True] * 3, width=2)


# ---------------------------------------------------------------------------------------------------
# End to end: every shape and mode pre-speculates in lockstep against a live verifier


def _generate(
    url: str, tree: TreeSpec, prespec: PrespecConfig | bool, **kw: Any
) -> tuple[list[int], GenerationStats]:
    drafter = create_drafter("torch", "tiny")

    async def go() -> tuple[list[int], GenerationStats]:
        link = LinkShape.rtt(600.0)  # a long round trip: conditional trees leave before the verdict
        async with EdgeClient(url, drafter, prespec=prespec, link=link, tree=tree, trace=True) as c:
            async for _ in c.generate("Once upon a time", **kw):
                pass
            assert c.last is not None
            return c.last.tokens, c.last.stats

    return asyncio.run(go())


def _batched(st: GenerationStats) -> int:
    """Conditional draft actions that drafted several trees together."""
    assert st.trace is not None
    return sum(1 for e in st.trace.drafts if e.kind == "conditional" and e.trees > 1)


def test_budget_trees_pre_speculate_in_lockstep_and_keep_the_output() -> None:
    """A budget shape with pre-speculation drafts several conditional trees per action in greedy
    (one evaluation per best-first round for all of them), one at a time in match, and gives
    exactly the output without it, greedy and seeded match."""
    cfg = PrespecConfig(fanout=3, gate=False, batch=4, batch_min_prob=0.0)
    tree = TreeSpec("budget", budget=12)
    with LiveServer(max_pending=16) as srv:
        for kw in ({}, {"mode": "match", "temperature": 0.8, "seed": 5}):
            off, _ = _generate(srv.ws, tree, False, max_new_tokens=32, **kw)
            on, st = _generate(srv.ws, tree, cfg, max_new_tokens=32, **kw)
            assert on == off, kw
            assert st.prespec_sent > 0, kw
            # budget trees join the lockstep in greedy only (in match the coupled ranking is dear)
            assert (_batched(st) > 0) if not kw else (_batched(st) == 0), kw


@pytest.mark.slow  # two live generations: ~30 s (the unit test above checks the sampled trees)
@pytest.mark.parametrize("mode", ["mss", "rrs"])
def test_sampled_trees_pre_speculate_in_lockstep(mode: str) -> None:
    """mss / rrs pre-speculation drafts its conditional trees together; the verifier checks every
    draw of every tree sent against its shipped q row (a bad one fails the generation)."""
    cfg = PrespecConfig(fanout=3, gate=False, batch=4, batch_min_prob=0.0)
    with LiveServer(trust_anonymous=True, max_pending=16) as srv:
        toks, st = _generate(srv.ws, TreeSpec(), cfg, max_new_tokens=32, mode=mode, temperature=1.0, seed=3)
    assert len(toks) == 32 or toks[-1] == 2
    assert st.prespec_sent > 0 and _batched(st) > 0


def test_the_builders_own_work_is_priced_into_an_evaluation() -> None:
    """A tree level's ranking and bookkeeping, outside the forward, is measured per row and added to
    the drafter's price of an evaluation (so planned chains end when they were planned to)."""
    d = FakeDrafter(V)
    assert d.stats.host_ms_per_row is None
    draft_static(d, S, ExpansionConfig((2, 2, 1)))
    host = d.stats.host_ms_per_row
    assert host is not None and host >= 0.0
    forward = d.stats.by_rows[2]
    assert d.stats.eval_ms(2) == pytest.approx(forward + 2 * host)
    conds = _outcome_conds(d)
    draft_static_many(d, S, ExpansionConfig((1, 1, 1)), conds)
    assert d.stats.host_ms_per_row is not None
