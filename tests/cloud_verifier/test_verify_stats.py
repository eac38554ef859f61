"""Statistical proof of exactness on the production functions (docs/architecture.md §4, issue item 4).

Each case runs `cloud_verifier.exactness.run_case`: >= 200,000 trials batched through
`cloud_verifier.verify.verify_batch`, a fresh tree drafted from q every round, and a Pearson
chi-square test of the joint distribution of the next 2 (3 for chains and <1,1,3>) output tokens
against the target alone (cells with expected count < 5 pooled, reject at p < 1e-6). The wrong
variants must be rejected by the same test. `SLOW=1` runs the full matrix.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cloud_verifier.exactness import (
    SHAPES,
    UNSHARED,
    Case,
    draw_round,
    full_matrix,
    pair_for,
    run_case,
    tokens_per_round,
)
from cloud_verifier.sampling import SamplingParams
from cloud_verifier.verify import TreeBatch
from shared import Q_TOTAL, SparseDist, SparseRows, TokenTree, merge
from shared.tree import Draws, ExpansionConfig

pytest.importorskip("scipy")  # the chi-square test of every case

SAMPLES = 200_000
DEFAULT = [
    Case("match", "merged", 1.0),
    Case("naive", "chain", 0.5),
    Case("mss", "specinfer", 1.0),
    Case("rrs", "wide", 0.5),
    # deliberately wrong, on shapes with >= 2 children on the walked path
    Case("mss/unnormalised-residual", "merged", 1.0),
    Case("mss/ratio-q-over-p", "wide", 0.5),
    Case("mss/moves-1%-mass", "wide", 1.0),
]


@pytest.mark.parametrize("kind", ["distinct", "replacement", "without"])
@pytest.mark.parametrize("shape", [*SHAPES.values(), UNSHARED], ids=lambda s: s.name)
def test_harness_trees_are_what_the_edge_sends(shape: object, kind: str) -> None:
    """The batched trees of the harness equal, trial by trial, `TreeBatch.from_tree` of the tree the
    edge would send: each drafter's expansion tree with its draws and u16 q rows, merged by
    `shared.tree.merge` (identical paths share a node; single drafters too unless share=False)."""
    assert isinstance(shape, type(UNSHARED))
    pair = pair_for(shape)
    gen = torch.Generator().manual_seed(5)
    root = torch.randint(0, pair.vocab, (60,), generator=gen)
    rnd = draw_round(pair, shape, kind, root, gen)
    stochastic = kind != "distinct"
    for i in range(60):
        parts = []
        for d, ks in enumerate(shape.expansions):
            parents = ExpansionConfig(ks).parents()
            toks = rnd.drafted[d][i].numpy()
            rows: list[SparseDist] = []
            qrow = np.zeros(parents.size, dtype=np.int32)
            for p in np.unique(parents):
                ctx = int(root[i]) if p < 0 else int(toks[p])
                w = pair.drafts[d][ctx].numpy()
                qrow[parents == p] = len(rows)
                rows.append(SparseDist.from_weights(np.flatnonzero(w), w[w > 0]))
            draws = Draws(np.arange(parents.size), np.full(parents.size, d), qrow, SparseRows.from_rows(rows))
            parts.append(TokenTree.build(toks, parents, base=7, cond=[int(root[i])], draws=draws))
        tree = merge(parts) if shape.share else parts[0]
        if not stochastic:
            tree = TokenTree.build(tree.tokens, tree.parents, tree.base, tree.cond)
        tree.validate(pair.vocab, 64, 8, stochastic=stochastic, without_replacement=kind == "without")
        want = TreeBatch.from_tree(tree)
        n, k = tree.num_nodes, want.slots.shape[2]
        assert rnd.tokens[i, :n].tolist() == want.tokens[0].tolist()
        assert rnd.slots[i, : n + 1, :k].tolist() == want.slots[0].tolist()
        assert bool((rnd.slots[i, : n + 1, k:] == -1).all()) and bool((rnd.slots[i, n + 1 :] == -1).all())
        if stochastic:
            assert rnd.qrow is not None and rnd.q_probs is not None and want.q_ids is not None
            assert want.qrow is not None
            assert rnd.qrow[i, : n + 1, :k].tolist() == want.qrow[0].tolist()
            assert want.q_probs is not None
            dense = torch.zeros(want.q_ids.shape[1], pair.vocab).scatter_add_(
                1, want.q_ids[0], want.q_probs[0]
            )
            assert torch.equal(rnd.q_probs[i, : dense.shape[0]] * Q_TOTAL, dense * Q_TOTAL)


# the chi-square matrix also runs with verification on a GPU (the sync-free device path)
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def _check(case: Case, device: str = "cpu") -> None:
    r = run_case(case, SAMPLES, device=device)
    verdict = "exact" if case.expected_exact else "a wrong variant"
    assert r.passed, f"{case.label()} on {device} is {verdict} but p = {r.p_value:.3g}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", DEFAULT, ids=Case.label)
def test_joint_output_distribution(case: Case, device: str) -> None:
    _check(case, device)


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", [c for c in full_matrix() if c not in DEFAULT], ids=Case.label)
def test_joint_output_distribution_full_matrix(case: Case, device: str) -> None:
    _check(case, device)


@pytest.mark.parametrize("temperature", [0.5, 1.0])
def test_mss_accepts_at_least_as_many_as_naive_on_the_same_trees(temperature: float) -> None:
    """SpecInfer Theorem 4.3, on every shape: the same sampled trees, verified both ways."""
    for shape in SHAPES.values():
        tpr = tokens_per_round(["naive", "mss"], shape, SamplingParams(temperature), 40_000, seed=1)
        diff = tpr["mss"] - tpr["naive"]
        se = float(diff.std()) / len(diff) ** 0.5
        assert float(diff.mean()) >= -3 * se, (
            shape.name,
            float(tpr["mss"].mean()),
            float(tpr["naive"].mean()),
        )


def test_rrs_accepts_at_least_as_many_as_mss_on_average() -> None:
    """Drafting without replacement (rrs) gives at least the acceptance of mss, averaged over the
    same draft/target pairs, shapes and temperatures (equal in law on chains: one draw per row)."""
    means: dict[str, list[torch.Tensor]] = {"mss": [], "rrs": []}
    for shape in SHAPES.values():
        for temperature in (0.5, 1.0):
            tpr = tokens_per_round(["mss", "rrs"], shape, SamplingParams(temperature), 40_000, seed=2)
            for mode in means:
                means[mode].append(tpr[mode])
    rrs, mss = torch.cat(means["rrs"]), torch.cat(means["mss"])
    se = (float(rrs.var()) / len(rrs) + float(mss.var()) / len(mss)) ** 0.5
    assert float(rrs.mean()) >= float(mss.mean()) - 3 * se, (float(rrs.mean()), float(mss.mean()))
