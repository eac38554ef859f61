"""Deterministic tests of verification: literal trees, reductions to greedy, path invariance, seeded
sample-and-match == target-only decoding, and the T = 1 walk == the batched walk."""

from __future__ import annotations

from typing import Any, cast

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from cloud_verifier.sampling import (
    SamplingParams,
    draw_proposals,
    inverse_cdf,
    sample_next,
    target_probs,
    top_p_threshold,
)
from cloud_verifier.verify import (
    MODES,
    Algorithm,
    TreeBatch,
    Uniforms,
    draw_slots,
    padded_rows,
    verify_batch,
    verify_tree,
)
from shared import Q_TOTAL, SparseDist, SparseRows, TokenTree, merge
from shared.keyed import keyed_uniform, keyed_uniforms
from shared.sparse import truncate
from shared.tree import Draws, ExpansionConfig
from tests.stats import chi2_pvalue

ALPHA = 1e-6


# --------------------------------------------------------------------------- helpers
def stochastic_tree(
    rng: np.random.Generator,
    q_logits: np.ndarray,
    ks: tuple[int, ...],
    root: int,
    without_replacement: bool,
    drafter: int = 0,
    base: int = 5,
) -> TokenTree:
    """One drafter's expansion tree drawn from a bigram draft q(. | last token) [V, V] (logits)."""
    parents = ExpansionConfig(ks).parents()
    tokens = np.zeros(parents.size, dtype=np.int64)
    rows: list[SparseDist] = []
    qrow = np.zeros(parents.size, dtype=np.int32)
    for p in np.unique(parents):
        kids = np.flatnonzero(parents == p)
        ctx = root if p < 0 else int(tokens[p])
        z = q_logits[ctx]
        q = SparseDist.from_probs(np.exp(z - z.max()), top_k=q_logits.shape[1] // 2)
        tokens[kids] = (
            q.sample_without_replacement(rng, kids.size) if without_replacement else q.sample(rng, kids.size)
        )
        qrow[kids] = len(rows)
        rows.append(q)
    n = parents.size
    draws = Draws(
        np.arange(n, dtype=np.int32), np.full(n, drafter, np.int32), qrow, SparseRows.from_rows(rows)
    )
    return TokenTree.build(tokens, parents, base=base, cond=[root], draws=draws)


def bigram(vocab: int, seed: int, scale: float = 2.0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    target = rng.normal(size=(vocab, vocab)) * scale
    draft = 0.7 * target + rng.normal(size=(vocab, vocab))
    return target.astype(np.float32), draft


def tree_logits(target: np.ndarray, root: int, tree: TokenTree) -> torch.Tensor:
    """[N + 1, V]: the bigram target's logits at row 0 and at every node."""
    return torch.from_numpy(target[np.concatenate([[root], tree.tokens])])


def random_trees(rng: np.random.Generator, draft: np.ndarray, root: int) -> list[TokenTree]:
    """Deterministic trees of several shapes (distinct siblings)."""
    shapes = [(1, 1, 1, 1), (1, 1, 3), (4, 1), (3, 2, 1)]
    trees = [stochastic_tree(rng, draft, ks, root, True) for ks in shapes]
    trees.append(
        merge(
            [stochastic_tree(rng, draft, (2, 1), root, True), stochastic_tree(rng, draft, (1, 2), root, True)]
        )
    )
    return [TokenTree.build(t.tokens, t.parents, t.base, t.cond) for t in trees] + [
        TokenTree.build([], [], 5, [root])
    ]


# --------------------------------------------------------------------------- sampling
def test_target_probs_temperature_and_greedy() -> None:
    logits = torch.randn(3, 4, 40, generator=torch.Generator().manual_seed(0))
    for temp in (0.5, 1.0, 2.0):
        p = target_probs(logits, SamplingParams(temp))
        assert p.shape == logits.shape and p.dtype == torch.float32
        torch.testing.assert_close(p, torch.softmax(logits / temp, -1))
    tied = torch.tensor([[0.0, 3.0, 1.0, 3.0]])
    assert target_probs(tied, SamplingParams(0.0)).tolist() == [[0.0, 1.0, 0.0, 0.0]]
    assert sample_next(tied[0], SamplingParams(), seed=1, position=9) == 1


@pytest.mark.parametrize("temp", [1e-29, 1e-31, 1e-38, 1e-45, 1e-300, 5e-324])
@pytest.mark.parametrize(("top_k", "top_p"), [(0, 1.0), (0, 0.5), (0, 0.9), (5, 1.0), (5, 0.5)])
def test_tiny_temperatures_give_the_argmax(temp: float, top_k: int, top_p: float) -> None:
    """Every temperature the protocol accepts samples correctly: where logits / T overflows, p is its
    T -> 0+ limit (all mass on the argmax), never NaN, so sampling is greedy (it was the last id)."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 300, generator=gen) * 8
    params = SamplingParams(temp, top_k, top_p)
    p = target_probs(logits, params)
    assert torch.isfinite(p).all()
    assert torch.equal(p, torch.zeros_like(p).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0))
    for row in range(4):
        assert sample_next(logits[row], params, seed=row, position=7) == int(logits[row].argmax())


def test_tiny_temperature_limit_spreads_over_tied_maxima() -> None:
    """The T -> 0+ limit of softmax(x / T) is uniform over the row's maxima."""
    tied = torch.tensor([[0.0, 3.0, 1.0, 3.0]])
    p = target_probs(tied, SamplingParams(1e-300))
    assert p.tolist() == [[0.0, 0.5, 0.0, 0.5]]


@pytest.mark.parametrize("vocab", [30, 3000])
def test_target_probs_top_k_top_p_match_reference(vocab: int) -> None:
    """top-k then top-p equals shared.sparse.truncate on the tempered probabilities (at 3000 tokens with
    flat logits, top-p needs more than the first 256 tokens and widens)."""
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(6, vocab, generator=gen) * (0.3 if vocab > 1000 else 2.0)
    for top_k, top_p in [(0, 0.9), (5, 1.0), (7, 0.6), (0, 0.3), (vocab, 0.95), (1, 0.5)]:
        params = SamplingParams(0.8, top_k, top_p)
        p = target_probs(logits, params).double().numpy()
        for row in range(6):
            ref = torch.softmax(logits[row].double() / 0.8, -1).numpy()
            keep = truncate(ref, top_k, top_p)
            want = np.zeros(vocab)
            want[keep] = ref[keep] / ref[keep].sum()
            np.testing.assert_allclose(p[row], want, atol=1e-6)


def test_top_p_threshold_is_exact() -> None:
    """The radix select (and the one-max shortcut) return exactly the smallest kept probability of
    the float64 sorted reference, on peaked and long-tailed rows."""
    gen = torch.Generator().manual_seed(9)
    for scale in (0.2, 1.0, 4.0, 12.0):
        probs = torch.softmax(torch.randn(16, 5000, generator=gen) * scale, -1)
        for top_p in (0.3, 0.9, 0.99):
            got = top_p_threshold(probs, top_p)
            for row in range(16):
                s, _ = torch.sort(probs[row], descending=True)
                before = s.double().cumsum(-1) - s.double()
                assert float(got[row]) == float(s[before < top_p].min()), (scale, top_p, row)


def test_sampling_params_validate() -> None:
    bads: list[dict[str, Any]] = [dict(temperature=-1.0), dict(top_k=-1), dict(top_p=0.0), dict(top_p=1.5)]
    for bad in bads:
        with pytest.raises(ValueError):
            SamplingParams(**bad)


def test_keyed_uniform() -> None:
    assert keyed_uniform(7, 100) == keyed_uniform(7, 100)
    assert keyed_uniform(7, 100) != keyed_uniform(7, 101) != keyed_uniform(8, 100)
    seeds = np.arange(50)[:, None]
    pos = np.arange(2000)[None, :]
    u = keyed_uniforms(seeds, pos)
    assert u.shape == (50, 2000) and u.dtype == np.float64
    assert u.min() >= 0.0 and u.max() < 1.0
    assert u[3, 17] == keyed_uniform(3, 17)
    counts = np.histogram(u, bins=50, range=(0, 1))[0]
    assert chi2_pvalue(counts, np.full(50, 1 / 50)) > ALPHA
    # neighbouring positions are not correlated
    assert abs(np.corrcoef(u[:, :-1].ravel(), u[:, 1:].ravel())[0, 1]) < 0.01


def test_inverse_cdf() -> None:
    gen = torch.Generator().manual_seed(1)
    probs = torch.rand(200, 700, generator=gen) ** 6
    probs[:, ::2] = 0.0
    probs[:, -1] = 0.0
    for u in (torch.zeros(200, dtype=torch.float64), torch.full((200,), 1 - 2**-53, dtype=torch.float64)):
        x = inverse_cdf(probs, u)
        assert bool((probs.gather(1, x[:, None]) > 0).all())
    u = torch.rand(200, dtype=torch.float64, generator=gen)
    cdf = probs.double().cumsum(-1)
    ref = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(-1), right=True).squeeze(-1)
    assert torch.equal(inverse_cdf(probs, u), ref)
    # distribution: one row, many uniforms
    p = torch.softmax(torch.randn(1, 12, generator=gen), -1)
    xs = inverse_cdf(p.expand(100_000, 12), torch.rand(100_000, dtype=torch.float64, generator=gen))
    assert chi2_pvalue(np.bincount(xs.numpy(), minlength=12), p[0].double().numpy()) > ALPHA


def test_sample_next_is_inverse_cdf_at_the_keyed_uniform() -> None:
    logits = torch.randn(50, generator=torch.Generator().manual_seed(2))
    params = SamplingParams(0.7, top_k=20, top_p=0.9)
    for pos in range(20):
        u = torch.tensor([keyed_uniform(11, pos)], dtype=torch.float64)
        assert sample_next(logits, params, 11, pos) == int(
            inverse_cdf(target_probs(logits[None], params), u)[0]
        )


# --------------------------------------------------------------------------- tree tensors
def test_draw_slots_and_padded_rows_literal() -> None:
    # two drafters; both drew token 7 first at row 0 (one shared node), drafter 0 also drew 8
    q0 = SparseRows.from_rows([SparseDist.from_weights([7, 8], [40000, 25536])])
    q1 = SparseRows.from_rows([SparseDist.from_weights([3, 7, 9], [1000, 60000, 4536])])
    a = TokenTree.build(
        [7, 8], [-1, -1], 4, draws=Draws(np.array([0, 1]), np.array([0, 0]), np.array([0, 0]), q0)
    )
    b = TokenTree.build([7], [-1], 4, draws=Draws(np.array([0]), np.array([1]), np.array([0]), q1))
    tree = merge([a, b])
    tree.validate(16, 8, 4, stochastic=True, without_replacement=True)
    slots, qrow = draw_slots(tree)
    assert slots.tolist() == [[0, 1, 0], [-1, -1, -1], [-1, -1, -1]]
    assert qrow.tolist() == [[0, 0, 1], [-1, -1, -1], [-1, -1, -1]]
    assert tree.draws is not None
    ids, probs = padded_rows(tree.draws.q)
    assert ids.tolist() == [[7, 8, 8], [3, 7, 9]]
    assert (probs * Q_TOTAL).tolist() == [[40000, 25536, 0], [1000, 60000, 4536]]
    det = TokenTree.build([5, 6, 7], [-1, 0, -1])
    assert draw_slots(det)[0].tolist() == [[0, 2], [1, -1], [-1, -1], [-1, -1]]
    # q_k(x_k): mss takes q(x); rrs removes the group's earlier draws and renormalises
    batch = TreeBatch.from_tree(tree)
    assert batch.qrow is not None and batch.q_ids is not None and batch.q_probs is not None
    toks = torch.tensor([[[7, 8, 7], [-1, -1, -1], [-1, -1, -1]]])
    cases: list[tuple[bool, list[float]]] = [
        (False, [40000, 25536, 60000]),
        (True, [40000, 25536 / (1 - 40000 / Q_TOTAL), 60000]),
    ]
    for wr, want in cases:
        got = draw_proposals(toks, batch.slots, batch.qrow, batch.q_ids, batch.q_probs, wr, 16)[0, 0]
        np.testing.assert_allclose(got.double().numpy() * Q_TOTAL, want, rtol=1e-6)


# --------------------------------------------------------------------------- literal verification
def test_greedy_literal_specinfer_tree() -> None:
    # SpecInfer Fig. 3 shape: row0 -> a(0) -> b(1) -> c(2); a -> d(3); row0 -> e(4)
    tree = TokenTree.build([10, 11, 12, 13, 14], [-1, 0, 1, 0, -1], base=3, cond=[9])
    logits = torch.zeros(6, 20)
    logits[0, 10] = logits[1, 13] = logits[4, 5] = 5.0  # row0 -> 10 (node 0) -> 13 (node 3) -> bonus 5
    logits[2, 12] = logits[3, 1] = logits[5, 2] = 5.0
    res = verify_tree(Algorithm.GREEDY, tree, logits, SamplingParams())
    assert (res.accepted_nodes, res.tokens, res.bonus) == ([0, 3], [10, 13, 5], 5)
    logits[0] = 0.0
    logits[0, 14] = 5.0  # -> node 4, a leaf: the bonus comes from node 4's row
    res = verify_tree(Algorithm.GREEDY, tree, logits, SamplingParams())
    assert (res.accepted_nodes, res.tokens) == ([4], [14, 2])
    logits[0] = 0.0
    logits[0, 3] = 5.0  # no child matches: the bonus only
    assert verify_tree(Algorithm.MATCH, tree, logits, SamplingParams(0.0)).tokens == [3]
    empty = TokenTree.build([], [], base=3, cond=[9])
    assert verify_tree(Algorithm.GREEDY, empty, logits[:1], SamplingParams()).tokens == [3]


def test_errors() -> None:
    tree = TokenTree.build([1, 2], [-1, 0], base=1)
    logits = torch.zeros(3, 8)
    with pytest.raises(TypeError, match="must be an Algorithm"):
        verify_tree(cast(Any, "greedy"), tree, logits, SamplingParams())
    with pytest.raises(ValueError, match="logits must be"):
        verify_tree(Algorithm.GREEDY, tree, logits[:2], SamplingParams())
    with pytest.raises(ValueError, match="stochastic tree"):
        verify_tree(Algorithm.MSS, tree, logits, SamplingParams(1.0))


def test_mss_accepts_every_draw_when_p_equals_q() -> None:
    """u * q(x) < p(x) always holds for p = q: the walk reaches a leaf every time."""
    rng = np.random.default_rng(3)
    q_logits = rng.normal(size=(16, 16))
    for _ in range(20):
        tree = stochastic_tree(rng, q_logits, (2, 2, 1), 4, False)
        assert tree.draws is not None
        # the target's row at each parent is exactly its q row
        rows = np.full((tree.num_nodes + 1, 16), -1e9, dtype=np.float32)
        for d in range(tree.draws.num_draws):
            r = int(tree.parents[tree.draws.node[d]]) + 1
            q = tree.draws.q.row(int(tree.draws.qrow[d]))
            rows[r, q.ids] = np.log(q.weights / Q_TOTAL)
        res = verify_tree(
            Algorithm.MSS, tree, torch.from_numpy(rows), SamplingParams(1.0), generator=torch.Generator()
        )
        assert len(res.accepted_nodes) == 3


# --------------------------------------------------------------------------- reductions and invariance
def test_temperature_zero_reduces_every_mode_to_greedy() -> None:
    target, draft = bigram(20, 4)
    rng = np.random.default_rng(4)
    for trial in range(30):
        root = trial % 20
        for wr in (False, True):
            tree = stochastic_tree(rng, draft, (3, 2, 1), root, wr)
            logits = tree_logits(target, root, tree)
            want = verify_tree(Algorithm.GREEDY, tree, logits, SamplingParams())
            for mode in MODES:
                if mode == "rrs" and not wr:
                    continue
                got = verify_tree(
                    mode, tree, logits, SamplingParams(0.0), seed=trial, generator=torch.Generator()
                )
                assert got == want, mode


@pytest.mark.parametrize(
    "params", [SamplingParams(), SamplingParams(1.0), SamplingParams(0.6, top_k=8, top_p=0.9)]
)
def test_speculation_emits_the_target_only_tokens_whatever_the_tree(params: SamplingParams) -> None:
    """greedy and seeded match are path-invariant: for any sequence of trees, the emitted tokens are
    exactly those of target-only decoding with sample_next (the server's mode ar)."""
    vocab, length = 24, 60
    target, draft = bigram(vocab, 5, scale=3.0)
    mode = Algorithm.GREEDY if params.greedy else Algorithm.MATCH
    for seed in range(4):
        root, start = 3, 9
        ar = [root]
        for pos in range(start, start + length):
            ar.append(sample_next(torch.from_numpy(target[ar[-1]]), params, seed, pos))
        rng = np.random.default_rng(seed)
        for builder in range(3):
            out = [root]
            while len(out) < length + 1:
                last = out[-1]
                if builder == 0:  # trees drafted from the draft model
                    tree = random_trees(rng, draft, last)[rng.integers(6)]
                elif builder == 1:  # a chain along the true continuation, cut at a random depth
                    k = len(out)
                    tree = TokenTree.chain(ar[k : k + rng.integers(0, 6)])
                else:  # the true continuation as one branch of a wide tree
                    k = len(out)
                    seqs = [ar[k : k + 4], *([int(t)] for t in rng.integers(0, vocab, 3))]
                    tree = TokenTree.from_sequences([s for s in seqs if s])
                tree = TokenTree.build(tree.tokens, tree.parents, base=start + len(out) - 2, cond=[last])
                res = verify_tree(mode, tree, tree_logits(target, last, tree), params, seed=seed)
                path = tree.path(res.accepted_nodes[-1]) if res.accepted_nodes else []
                assert res.accepted_nodes == path and res.tokens[:-1] == [int(tree.tokens[i]) for i in path]
                out.extend(res.tokens)
            assert out[: length + 1] == ar, (seed, builder)


@pytest.mark.parametrize("mode", MODES)
def test_single_tree_walk_equals_batched_walk(mode: Algorithm) -> None:
    """verify_tree / verify_batch with T = 1 (rows fetched as views) and verify_batch over a stack of
    different trees (leaves at several depths; rows fetched by index_select) agree trial by trial,
    given the same uniforms."""
    vocab = 30
    target, draft = bigram(vocab, 6)
    rng = np.random.default_rng(6)
    params = SamplingParams(0.9, top_p=0.95)
    wr = mode in ("rrs", "greedy", "match")
    shapes = [((2, 1), (2,)), ((1, 1, 3),), ((3,),), ((2, 2), (1, 1, 1)), ((1,),)]
    trees, roots = [], []
    for i in range(15):
        root = int(rng.integers(vocab))
        parts = [stochastic_tree(rng, draft, ks, root, wr, d) for d, ks in enumerate(shapes[i % len(shapes)])]
        tree = merge(parts)
        if mode in ("greedy", "match"):
            tree = TokenTree.build(tree.tokens, tree.parents, 5 + i, [root])
        trees.append(tree)
        roots.append(root)
    singles = [TreeBatch.from_tree(t) for t in trees]
    n = max(t.num_nodes for t in trees)
    steps = max(b.depth for b in singles) + 1
    k = max(b.slots.shape[2] for b in singles)
    gen = torch.Generator().manual_seed(0)
    u = Uniforms(
        torch.rand(len(trees), steps, dtype=torch.float64, generator=gen),
        torch.rand(len(trees), steps, k, generator=gen),
    )
    logits = [tree_logits(target, root, tree) for tree, root in zip(trees, roots, strict=True)]
    stacked = verify_batch(
        mode,
        TreeBatch.stack(singles),
        torch.stack([F.pad(x, (0, 0, 0, n + 1 - x.shape[0])) for x in logits]),
        params,
        seeds=np.arange(len(trees)),
        uniforms=u,
    )
    for i, (tree, single) in enumerate(zip(trees, singles, strict=True)):
        d, kk = single.depth + 1, single.slots.shape[2]
        ui = Uniforms(u.sample[i : i + 1, :d], None if u.accept is None else u.accept[i : i + 1, :d, :kk])
        one = verify_batch(mode, single, logits[i][None], params, seeds=i, uniforms=ui)
        m = int(one.num_accepted[0])
        assert int(stacked.num_accepted[i]) == m
        assert stacked.tokens[i, : m + 1].tolist() == one.tokens[0, : m + 1].tolist()
        assert stacked.accepted[i, :m].tolist() == one.accepted[0, :m].tolist()
        if mode in ("greedy", "match"):
            res = verify_tree(mode, tree, logits[i], params, seed=i)
            assert (res.accepted_nodes, res.tokens) == (
                one.accepted[0, :m].tolist(),
                one.tokens[0, : m + 1].tolist(),
            )


@pytest.mark.gpu
def test_verify_on_cuda() -> None:
    """Where the logits live on a GPU, verification runs there: greedy and seeded match give the CPU's
    tokens, and the stochastic modes run with a CUDA generator."""
    target, draft = bigram(64, 7)
    rng = np.random.default_rng(7)
    params = SamplingParams(0.8, top_k=20)
    gen = torch.Generator(device="cuda").manual_seed(0)
    for i in range(10):
        root = i % 64
        for mode in MODES:
            tree = stochastic_tree(rng, draft, (2, 2, 1), root, mode != "mss" and mode != "naive")
            if mode in ("greedy", "match"):
                tree = TokenTree.build(tree.tokens, tree.parents, tree.base, tree.cond)
            logits = tree_logits(target, root, tree)
            got = verify_tree(mode, tree, logits.cuda(), params, seed=i, generator=gen)
            if mode in ("greedy", "match"):
                assert got == verify_tree(mode, tree, logits, params, seed=i)
            assert got.accepted_nodes == (tree.path(got.accepted_nodes[-1]) if got.accepted_nodes else [])
            assert 0 <= got.bonus < 64
