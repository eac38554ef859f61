"""Tree builders: shapes, ranks, budgets, draws and their statistics (edge_client/trees.py).

Most tests use the model-free FakeDrafter (exact logits as a function of the prefix), so they can
check every node against an independent computation; a few run the real llama.cpp draft.
"""

from __future__ import annotations

import heapq
import math
from pathlib import Path

import numpy as np
import pytest

from edge_client.drafters import WorkspaceFullError
from edge_client.drafters.llama_cpp import LlamaCppDrafter
from edge_client.trees import (
    Coupling,
    DraftCancelled,
    DraftOptions,
    DraftResult,
    Sampling,
    draft_dynamic,
    draft_sequence,
    draft_static,
    finish_leaves,
)
from shared.sparse import Q_TOTAL
from shared.tree import ExpansionConfig
from tests.edge_client.fake_drafter import FakeDrafter, fake_logits
from tests.stats import chi2_pvalue

V = 64
S = [3, 14, 15, 9, 26, 5]
ALPHA = 1e-6


def _logp(prefix: list[int]) -> np.ndarray:
    x = fake_logits(prefix, V).astype(np.float64)
    logp: np.ndarray = x - (x.max() + np.log(np.exp(x - x.max()).sum()))
    return logp


def _check_result(r: DraftResult, committed: list[int], cond: tuple[int, ...] = ()) -> None:
    t = r.tree
    n = t.num_nodes
    assert t.base == len(committed) and t.cond.tolist() == list(cond)
    assert r.node_prob.shape == r.path_prob.shape == r.workspace_ids.shape == (n,)
    assert r.alt_tokens.shape[0] == r.alt_probs.shape[0] == n + 1
    for i in range(n):
        p = int(t.parents[i])
        expect = r.node_prob[i] * (r.path_prob[p] if p >= 0 else 1.0)
        assert r.path_prob[i] == pytest.approx(expect, rel=1e-5)


# ------------------------------------------------------------------------------------ static
@pytest.mark.parametrize("ks", [(1, 1, 3, 1, 1, 1, 1, 1), (2, 2, 2), (4,), (3, 1, 2)])
def test_static_tree_is_the_expansion_of_top_k(ks: tuple[int, ...]) -> None:
    d = FakeDrafter(V)
    cfg = ExpansionConfig(ks)
    r = draft_static(d, S, cfg)
    t = r.tree
    assert t.num_nodes == cfg.num_nodes
    assert t.parents.tolist() == cfg.parents().tolist()
    t.validate(V, 256, 16, stochastic=False)  # distinct siblings among others
    for parent in [-1, *range(t.num_nodes)]:
        kids = t.children_of(parent)
        if not kids:
            continue
        prefix = S + (t.path_tokens(parent) if parent >= 0 else [])
        logp = _logp(prefix)
        assert [int(t.tokens[c]) for c in kids] == np.argsort(-logp, kind="stable")[: len(kids)].tolist()
        for c in kids:
            assert r.node_prob[c] == pytest.approx(math.exp(logp[t.tokens[c]]), rel=1e-5)
    _check_result(r, S)
    # one evaluation per level but the last; leaves are not evaluated
    assert r.evaluations == len(ks) - 1
    leaves = set(t.leaves())
    assert all(
        (r.workspace_ids[i] < 0) == (i in leaves and t.depth[i] == len(ks)) for i in range(t.num_nodes)
    )


def test_alternatives_are_the_drafts_top_tokens() -> None:
    d = FakeDrafter(V)
    r = draft_static(d, S, ExpansionConfig((2, 1)), DraftOptions(alternatives=5))
    logp = _logp(S)
    assert r.alt_tokens[0].tolist() == np.argsort(-logp, kind="stable")[:5].tolist()
    np.testing.assert_allclose(r.alt_probs[0], np.exp(np.sort(logp)[::-1][:5]), rtol=1e-5)
    assert np.all(r.alt_tokens[1:3] >= 0)  # depth-1 nodes were evaluated
    assert np.all(r.alt_tokens[3:] == -1)  # leaves were not


def test_eval_leaves_evaluates_everything() -> None:
    d = FakeDrafter(V)
    r = draft_static(d, S, ExpansionConfig((2, 2)), DraftOptions(eval_leaves=True))
    assert np.all(r.workspace_ids >= 0) and np.all(r.alt_tokens >= 0)
    assert d.num_nodes == 6 and r.evaluations == 2
    leaf = r.tree.leaves()[0]
    prefix = S + r.tree.path_tokens(leaf)
    assert r.alt_tokens[leaf + 1, 0] == int(np.argmax(_logp(prefix)))


@pytest.mark.parametrize("mode", ["greedy", "mss"])
def test_finish_leaves_equals_drafting_with_eval_leaves(mode: str) -> None:
    """A tree sent without its leaves and finished later believes what one drafted with
    eval_leaves believes: same tree, same alternatives after every node, leaves in the workspace."""
    cfg = ExpansionConfig((1, 3, 2))
    sampling = Sampling(temperature=0.8, wire_top_k=8) if mode == "mss" else None
    d1, d2 = FakeDrafter(V), FakeDrafter(V)
    full = draft_static(
        d1, S, cfg, DraftOptions(mode=mode, sampling=sampling, rng=np.random.default_rng(3), eval_leaves=True)
    )
    part = draft_static(d2, S, cfg, DraftOptions(mode=mode, sampling=sampling, rng=np.random.default_rng(3)))
    assert np.any(part.workspace_ids < 0) and np.any(part.alt_tokens < 0)
    done = finish_leaves(d2, part, DraftOptions(mode=mode, sampling=sampling))
    assert done.tree.tokens.tolist() == full.tree.tokens.tolist()
    np.testing.assert_array_equal(done.alt_tokens, full.alt_tokens)
    np.testing.assert_allclose(done.alt_probs, full.alt_probs, rtol=1e-6)
    assert np.all(done.workspace_ids >= 0) and d2.num_nodes == d1.num_nodes
    assert done.evaluations == part.evaluations + 1
    assert np.any(part.workspace_ids < 0)  # the original result is left as it was
    # each leaf's workspace node really continues its path
    for leaf in done.tree.leaves():
        assert d2.find_child(
            int(done.workspace_ids[done.tree.parents[leaf]]), int(done.tree.tokens[leaf])
        ) == int(done.workspace_ids[leaf])
    assert (
        finish_leaves(d2, done, DraftOptions(mode=mode, sampling=sampling)) is done
    )  # nothing left to evaluate


def test_finish_leaves_evaluates_only_the_leaves_asked_for() -> None:
    """`nodes` picks leaves: they get the rows a full finish gives them, the others stay
    unevaluated (and can be added later); a node that is not an unevaluated one is refused."""
    cfg = ExpansionConfig((1, 3, 2))
    d1, d2 = FakeDrafter(V), FakeDrafter(V)
    full = finish_leaves(d1, draft_static(d1, S, cfg))
    part = draft_static(d2, S, cfg)
    leaves = np.flatnonzero(part.workspace_ids < 0).tolist()
    pick = leaves[1::2]
    some = finish_leaves(d2, part, nodes=pick)
    rest = sorted(set(leaves) - set(pick))
    assert np.all(some.workspace_ids[pick] >= 0) and np.all(some.workspace_ids[rest] < 0)
    assert d2.num_nodes == d1.num_nodes - len(rest)
    for n in pick:
        np.testing.assert_array_equal(some.alt_tokens[n + 1], full.alt_tokens[n + 1])
    for n in rest:
        assert np.all(some.alt_tokens[n + 1] < 0)
    with pytest.raises(ValueError, match=r"not unevaluated nodes"):
        finish_leaves(d2, some, nodes=[pick[0]])  # already evaluated
    with pytest.raises(ValueError, match=r"not unevaluated nodes"):
        finish_leaves(d2, some, nodes=[some.tree.num_nodes])  # no such node
    done = finish_leaves(d2, some)  # the rest, later
    np.testing.assert_array_equal(done.alt_tokens, full.alt_tokens)
    assert np.all(done.workspace_ids >= 0)


def test_finish_leaves_of_a_dynamic_tree() -> None:
    d1, d2 = FakeDrafter(V), FakeDrafter(V)
    full = draft_dynamic(d1, S, 12, DraftOptions(eval_leaves=True))
    done = finish_leaves(d2, draft_dynamic(d2, S, 12))
    np.testing.assert_array_equal(done.alt_tokens, full.alt_tokens)
    assert np.all(done.workspace_ids >= 0)


def test_stop_abandons_drafting_between_evaluations() -> None:
    d = FakeDrafter(V)
    asked: list[int] = []

    def stop() -> bool:
        asked.append(d.stats.extend_calls)
        return len(asked) >= 3  # the third time it is asked

    with pytest.raises(DraftCancelled):
        draft_static(d, S, ExpansionConfig((1, 1, 1, 1, 1, 1)), DraftOptions(stop=stop))
    assert len(asked) == 3 and d.num_nodes == 2  # two levels evaluated, then it stopped
    # the workspace is still usable: a tree below the same sequence drafts as on a fresh one
    r = draft_static(d, S, ExpansionConfig((1, 1, 1)), DraftOptions(reuse_workspace=True, eval_leaves=True))
    fresh = draft_static(FakeDrafter(V), S, ExpansionConfig((1, 1, 1)), DraftOptions(eval_leaves=True))
    assert d.num_nodes == 2 + 3 and r.tree.tokens.tolist() == fresh.tree.tokens.tolist()
    np.testing.assert_array_equal(r.alt_tokens, fresh.alt_tokens)
    with pytest.raises(DraftCancelled):
        draft_dynamic(FakeDrafter(V), S, 20, DraftOptions(stop=lambda: True))
    # never asked before the first evaluation of a one-level tree, nor when it says go on
    assert (
        draft_static(FakeDrafter(V), S, ExpansionConfig((4,)), DraftOptions(stop=lambda: True)).tree.num_nodes
        == 4
    )
    assert (
        draft_static(
            FakeDrafter(V), S, ExpansionConfig((2, 2)), DraftOptions(stop=lambda: False)
        ).tree.num_nodes
        == 6
    )


def test_sequence_is_a_chain_of_the_greedy_path() -> None:
    d = FakeDrafter(V)
    r = draft_sequence(d, S, 6)
    t = r.tree
    assert t.parents.tolist() == [-1, 0, 1, 2, 3, 4]
    prefix = list(S)
    for tok in t.tokens.tolist():
        assert tok == int(np.argmax(_logp(prefix)))
        prefix.append(tok)


def test_too_wide_a_tree_is_refused_before_drafting() -> None:
    d = FakeDrafter(V, max_leaves=8)
    with pytest.raises(WorkspaceFullError, match="max_leaves"):
        draft_static(d, S, ExpansionConfig((4, 4, 2)))
    assert d.stats.sync_calls == 0
    draft_static(d, S, ExpansionConfig((4, 2, 4)))  # the last level is not evaluated: 8 leaves fit


def test_mode_ar_drafts_nothing_and_stochastic_needs_sampling() -> None:
    d = FakeDrafter(V)
    with pytest.raises(ValueError, match="target-only"):
        draft_static(d, S, ExpansionConfig(), DraftOptions(mode="ar"))
    with pytest.raises(ValueError, match="sampling"):
        draft_static(d, S, ExpansionConfig(), DraftOptions(mode="mss"))
    with pytest.raises(ValueError, match="temperature"):
        Sampling(temperature=0.0)
    with pytest.raises(ValueError, match="static"):
        draft_dynamic(d, S, 8, DraftOptions(mode="rrs"))


# ------------------------------------------------------------------------------------ conditional
def test_conditional_tree_from_a_fresh_sync() -> None:
    d = FakeDrafter(V)
    cond = (7, 8)
    r = draft_static(d, S, ExpansionConfig((2, 1)), DraftOptions(cond=cond))
    _check_result(r, S, cond)
    assert r.tree.committed_len == len(S) + 2
    assert d.committed_tokens() == S + list(cond)
    assert r.tree.tokens[0] == int(np.argmax(_logp(S + list(cond))))


def test_conditional_tree_below_the_tree_in_flight() -> None:
    d = FakeDrafter(V)
    first = draft_static(d, S, ExpansionConfig((2, 2)), DraftOptions(eval_leaves=True))
    held = d.num_nodes
    path = first.tree.path_tokens(first.tree.leaves()[0])  # assume this path accepted ...
    bonus = int(first.alt_tokens[first.tree.leaves()[0] + 1, 1])  # ... and a second-choice bonus
    cond = (*path, bonus)
    r = draft_static(d, S, ExpansionConfig((2, 1)), DraftOptions(cond=cond, reuse_workspace=True))
    _check_result(r, S, cond)
    assert d.num_nodes == held + 1 + 2  # the bonus node, then one evaluated level; the first tree stays
    assert d.path_to(r.root_id)[:-1] == [
        int(first.workspace_ids[i]) for i in first.tree.path(first.tree.leaves()[0])
    ]
    assert r.tree.tokens[0] == int(np.argmax(_logp(S + list(cond))))
    with pytest.raises(ValueError, match="synced"):
        draft_static(d, S[:-1], ExpansionConfig(), DraftOptions(cond=cond, reuse_workspace=True))


# ------------------------------------------------------------------------------------ dynamic
def _best_first(budget: int, branch: int, max_depth: int) -> set[tuple[int, ...]]:
    """Sequential best-first (one evaluation per node): the reference for width=1."""
    heap: list[tuple[float, int, tuple[int, ...]]] = []
    count = 0

    def push(path: tuple[int, ...], base: float) -> None:
        nonlocal count
        logp = _logp(S + list(path))
        for tok in np.argsort(-logp, kind="stable")[:branch].tolist():
            heapq.heappush(heap, (-(base + logp[tok]), count, (*path, tok)))
            count += 1

    push((), 0.0)
    chosen: set[tuple[int, ...]] = set()
    while len(chosen) < budget:
        neg, _, path = heapq.heappop(heap)
        chosen.add(path)
        if len(path) < max_depth:
            push(path, -neg)
    return chosen


@pytest.mark.parametrize(("budget", "branch", "max_depth"), [(10, 3, 16), (24, 4, 5), (7, 1, 16)])
def test_dynamic_with_width_one_is_exact_best_first(budget: int, branch: int, max_depth: int) -> None:
    d = FakeDrafter(V)
    r = draft_dynamic(d, S, budget, width=1, branch=branch, max_depth=max_depth)
    assert r.tree.num_nodes == budget
    assert r.tree.paths() == _best_first(budget, branch, max_depth)
    r.tree.validate(V, budget, max_depth, stochastic=False)
    _check_result(r, S)
    assert r.evaluations == budget - 1  # every node but the last one chosen
    if branch > 1:  # the left-out candidates are never better than a chosen node
        assert r.frontier_probs.max() <= r.path_prob.min() * (1 + 1e-5)


@pytest.mark.parametrize("budget", [1, 5, 16, 40])
def test_dynamic_batches_levels_and_respects_the_budget(budget: int) -> None:
    d = FakeDrafter(V)
    r = draft_dynamic(d, S, budget, width=16, branch=4, max_depth=6)
    t = r.tree
    assert t.num_nodes == budget
    t.validate(V, budget, 6, stochastic=False)
    _check_result(r, S)
    assert r.evaluations <= max(1, budget - 1)
    exact = _best_first(budget, 4, 6)
    got = sum(float(np.exp(sum(_logp(S + list(p[:i]))[p[i]] for i in range(len(p))))) for p in t.paths())
    best = sum(float(np.exp(sum(_logp(S + list(p[:i]))[p[i]] for i in range(len(p))))) for p in exact)
    assert got >= 0.8 * best  # batching costs little expected length


def test_dynamic_budget_over_the_workspace_is_refused() -> None:
    d = FakeDrafter(V, max_nodes=16)
    with pytest.raises(WorkspaceFullError, match="budget"):
        draft_dynamic(d, S, 17)


# ------------------------------------------------------------------------------------ stochastic
@pytest.mark.parametrize("mode", ["mss", "rrs"])
def test_stochastic_trees_carry_exact_draw_counts_and_rows(mode: str) -> None:
    d = FakeDrafter(V)
    cfg = ExpansionConfig((3, 2, 2))
    sampling = Sampling(temperature=1.2, top_k=20, top_p=0.9, wire_top_k=8)
    rng = np.random.default_rng(7)
    for _ in range(20):
        r = draft_static(d, S, cfg, DraftOptions(mode=mode, sampling=sampling, rng=rng))
        t = r.tree
        draws = t.draws
        assert draws is not None
        t.validate(V, 64, 8, stochastic=True, without_replacement=(mode == "rrs"))
        for parent in [-1, *range(t.num_nodes)]:
            at = t.draws_at(parent)
            if parent >= 0 and t.depth[parent] == cfg.depth:
                assert not at
                continue
            prefix = S + (t.path_tokens(parent) if parent >= 0 else [])
            q = sampling.q_row(fake_logits(prefix, V))
            k = cfg.ks[t.depth[parent] if parent >= 0 else 0]
            assert len(at) == (k if mode == "mss" else min(k, len(q)))  # fixed before drawing
            assert len(q) <= 8
            for dr in at:
                row = draws.q.row(int(draws.qrow[dr]))
                assert row.ids.tolist() == q.ids.tolist() and row.weights.tolist() == q.weights.tolist()
                node = int(draws.node[dr])
                assert r.node_prob[node] == pytest.approx(q.prob(int(t.tokens[node])), rel=1e-6)
        assert draws.num_draws >= t.num_nodes


def test_mss_duplicates_share_a_node_and_keep_their_draws() -> None:
    d = FakeDrafter(V)
    sampling = Sampling(temperature=0.3, wire_top_k=4)  # peaked: duplicates are common
    r = draft_static(
        d, S, ExpansionConfig((6,)), DraftOptions(mode="mss", sampling=sampling, rng=np.random.default_rng(1))
    )
    t = r.tree
    assert t.draws is not None and t.draws.num_draws == 6
    assert t.num_nodes < 6
    assert sorted(set(t.draws.node.tolist())) == list(range(t.num_nodes))


def _draw_counts(mode: str, sampling: Sampling, trees: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """First and second root draws over many independent trees ⟨2⟩: counts [V] each."""
    d = FakeDrafter(V)
    rng = np.random.default_rng(seed)
    first = np.zeros(V)
    second = np.zeros(V)
    for _ in range(trees):
        t = draft_static(
            d, S, ExpansionConfig((2,)), DraftOptions(mode=mode, sampling=sampling, rng=rng)
        ).tree
        assert t.draws is not None
        toks = t.tokens[t.draws.node]
        first[toks[0]] += 1
        second[toks[1]] += 1
    return first, second


SAMPLING = Sampling(temperature=1.3, top_k=30, top_p=0.95, wire_top_k=24)


@pytest.mark.parametrize("mode", ["mss", "rrs"])
def test_draws_follow_q(mode: str) -> None:
    """χ²: the first draw follows q; the second follows q (mss) or q without the first (rrs)."""
    q = SAMPLING.q_row(fake_logits(S, V)).dense(V)
    first, second = _draw_counts(mode, SAMPLING, 20000, seed=11)
    assert chi2_pvalue(first, q) > ALPHA
    if mode == "mss":
        expect = q
    else:  # P(second = y) = sum over x != y of q(x) q(y) / (1 - q(x))
        expect = q * (q / (1 - np.minimum(q, 1 - 1e-12))).sum() - q * q / (1 - np.minimum(q, 1 - 1e-12))
    assert chi2_pvalue(second, expect) > ALPHA
    assert first.sum() == 20000


def test_a_wrong_sampler_fails_the_same_check() -> None:
    """The χ² check has power: draws at temperature 1.3 do not pass as the row at temperature 0.9."""
    wrong = Sampling(temperature=0.9, top_k=30, top_p=0.95, wire_top_k=24).q_row(fake_logits(S, V)).dense(V)
    first, _ = _draw_counts("mss", SAMPLING, 20000, seed=12)
    assert chi2_pvalue(first, wrong) < ALPHA


def test_q_rows_are_quantized_before_sampling() -> None:
    q = SAMPLING.q_row(fake_logits(S, V))
    assert int(q.weights.sum()) == Q_TOTAL and len(q) <= 24
    p = np.exp(fake_logits(S, V).astype(np.float64) / 1.3)
    p /= p.sum()
    top = np.argsort(-p)[: len(q)]
    assert sorted(top.tolist()) == q.ids.tolist()  # the row is the draft's top set


# ------------------------------------------------------------------------------------ real draft
@pytest.fixture(scope="module")
def llama(smollm2_path: Path) -> LlamaCppDrafter:
    return LlamaCppDrafter(smollm2_path, n_threads=1, max_context=512, max_nodes=128, max_leaves=64)


def test_default_tree_on_the_real_draft(llama: LlamaCppDrafter) -> None:
    tok = llama.tokenizer
    s = tok.encode(tok.render_chat([{"role": "user", "content": "Name three colours."}]))
    r = draft_static(llama, s)
    t = r.tree
    assert t.num_nodes == ExpansionConfig().num_nodes == 20
    t.validate(tok.vocab_size, 64, 16, stochastic=False)
    # the three siblings at depth 3 are the draft's top 3 there
    branch = t.children_of(1)
    logits = llama.logits_at(int(r.workspace_ids[1]))
    assert [int(t.tokens[c]) for c in branch] == np.argsort(-logits, kind="stable")[:3].tolist()
    assert 0 < r.expected_accepted <= 8
    assert r.evaluations == 7


def test_real_dynamic_and_rrs_trees(llama: LlamaCppDrafter) -> None:
    tok = llama.tokenizer
    s = tok.encode("The quick brown fox")
    r = draft_dynamic(llama, s, 24, width=8)
    assert r.tree.num_nodes == 24
    r.tree.validate(tok.vocab_size, 64, 16, stochastic=False)
    r = draft_static(
        llama,
        s,
        ExpansionConfig(),
        DraftOptions(
            mode="rrs", sampling=Sampling(temperature=0.8, top_p=0.95), rng=np.random.default_rng(0)
        ),
    )
    r.tree.validate(tok.vocab_size, 64, 16, stochastic=True, without_replacement=True)


def test_a_fresh_tree_fits_after_a_full_workspace() -> None:
    """A tree drafted from a sync starts with an empty workspace, however full it was before."""
    d = FakeDrafter(64, max_nodes=24)
    first = draft_static(d, [1, 2, 3], ExpansionConfig((2, 2, 2)), DraftOptions(eval_leaves=True))
    assert d.num_nodes == first.tree.num_nodes == 14
    with pytest.raises(WorkspaceFullError):
        draft_static(
            d, [1, 2, 3], ExpansionConfig((2, 2, 2)), DraftOptions(eval_leaves=True, reuse_workspace=True)
        )
    again = draft_static(d, [1, 2, 3, 4], ExpansionConfig((2, 2, 2)), DraftOptions(eval_leaves=True))
    assert again.tree.num_nodes == 14
    dyn = draft_dynamic(d, [1, 2, 3, 4, 5], 20)
    assert dyn.tree.num_nodes == 20


# ---------------------------------------------------------------- coupled sample-and-match drafting


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"), [(0.7, 0, 1.0), (1.3, 0, 1.0), (0.9, 20, 1.0), (0.8, 0, 0.9)]
)
def test_coupling_token_is_the_verifiers_keyed_sample(temperature: float, top_k: int, top_p: float) -> None:
    """Coupling.token on logits equals the verifier's own draw there (sample_next: inverse CDF of
    target_probs at keyed_uniform(seed, position)): with the target's logits the edge would
    predict every sample."""
    import torch

    from cloud_verifier.sampling import SamplingParams, sample_next

    rng = np.random.default_rng(5)
    c = Coupling(seed=17, temperature=temperature, top_k=top_k, top_p=top_p)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    same = 0
    picked = set()
    for pos in range(200):
        logits = (rng.normal(0, 2, 500) + 3 * (rng.random(500) < 0.01)).astype(np.float32)
        mine = c.token(logits, pos)
        same += mine == sample_next(torch.from_numpy(logits), params, 17, pos)
        picked.add(mine)
    # float32 (target) and float64 (edge) CDFs may split a boundary differently: allow one in 100
    assert same >= 198
    assert len(picked) > 20  # it samples: not the argmax every time


def test_coupled_static_tree_leads_with_the_coupled_token() -> None:
    d = FakeDrafter(V)
    c = Coupling(seed=3, temperature=0.9)
    cfg = ExpansionConfig((2, 2, 1))
    dr = draft_static(d, S, cfg, DraftOptions(mode="match", coupling=c, eval_leaves=True))
    tree = dr.tree
    for row in range(tree.num_nodes + 1):
        j = row - 1
        path = [int(tree.tokens[i]) for i in tree.path(j)] if j >= 0 else []
        want = c.token(fake_logits(S + path, V), len(S) + len(path))
        assert int(dr.alt_tokens[row][0]) == want  # the outcome model's "top" token
        kids = tree.children_of(j)
        if kids:
            assert int(tree.tokens[kids[0]]) == want  # the first child
            assert len({int(tree.tokens[k]) for k in kids}) == len(kids)  # siblings stay distinct
    # the tree's draft probabilities stay the draft's own (temperature 1), coupled or not
    for i in range(tree.num_nodes):
        p = tree.parents[i]
        path = [int(tree.tokens[a]) for a in tree.path(p)] if p >= 0 else []
        assert dr.node_prob[i] == pytest.approx(math.exp(_logp(S + path)[int(tree.tokens[i])]), rel=1e-5)
    # greedy ignores the coupling; finish_leaves fills the leaves' rows the same way
    plain = draft_static(FakeDrafter(V), S, cfg, DraftOptions(mode="greedy"))
    assert draft_static(
        FakeDrafter(V), S, cfg, DraftOptions(mode="greedy", coupling=c)
    ).tree.tokens.tolist() == (plain.tree.tokens.tolist())
    d2 = FakeDrafter(V)
    match_c = DraftOptions(mode="match", coupling=c)
    late = finish_leaves(d2, draft_static(d2, S, cfg, match_c), match_c)
    assert late.alt_tokens.tolist() == dr.alt_tokens.tolist()


def test_coupled_dynamic_tree_holds_the_coupled_chain() -> None:
    """Best-first ranks a coupled token like the most likely one: the chain of coupled tokens from
    the root is in a budgeted tree, three levels deep."""
    c = Coupling(seed=8, temperature=1.0)
    dr = draft_dynamic(FakeDrafter(V), S, 24, DraftOptions(mode="match", coupling=c))
    tree = dr.tree
    node, prefix = -1, list(S)
    for _ in range(3):
        want = c.token(fake_logits(prefix, V), len(prefix))
        kids = [k for k in tree.children_of(node) if int(tree.tokens[k]) == want]
        assert kids, f"coupled token {want} missing below node {node}"
        node = kids[0]
        prefix.append(want)


@pytest.mark.parametrize("temp", [1e-31, 1e-45, 1e-300, 5e-324])
def test_tiny_temperatures_draft_the_argmax(temp: float) -> None:
    """Where logits / T overflows even in float64, the edge's q row and coupled token take the
    T -> 0+ limit (the argmax) instead of NaN."""
    logits = np.random.default_rng(4).normal(size=500) * 8
    top = int(np.argmax(logits))
    q = Sampling(temp, 0, 0.9).q_row(logits)
    assert q.ids.tolist() == [top] and int(q.weights.sum()) == Q_TOTAL
    assert Coupling(seed=3, temperature=temp).token(logits, 11) == top
