"""Saguaro sampling keeps mss / rrs exact (docs/architecture.md §4; edge_client.trees.Saguaro).

The harness (cloud_verifier.exactness) drafts every round from its bigram draft table and ships the
same table's rows; here the table's rows are replaced by the rows the edge ships under Saguaro
sampling (`Saguaro.apply`: the fanout + k heaviest tokens of each row scaled by C, k the draws at
every node of the shape), and the joint distribution of the next output tokens, verified by the
production `verify_batch`, is tested against the target alone (Pearson chi-square, reject at
p < 1e-6). The wrong variant draws from the scaled rows but ships the draft's own rows (C applied to
drafting, not to the q the verifier gets): the same test must reject it. The last test shows what C
buys: after a rejection the bonus is a cached candidate more often.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from cloud_verifier.exactness import (
    ALPHA,
    SHAPES,
    Pair,
    Round,
    Shape,
    chi2_pvalue,
    draw_round,
    joint_probs,
    pair_for,
    reference_probs,
    simulate,
)
from cloud_verifier.exactness import cases as harness
from cloud_verifier.exactness.rounds import START_LEN, START_TOKEN, rows_of
from cloud_verifier.sampling import SamplingParams
from cloud_verifier.verify import Algorithm, verify_batch
from edge_client.trees import Saguaro
from shared.sparse import Q_TOTAL, SparseDist
from shared.tree import ExpansionConfig

pytest.importorskip("scipy")  # the chi-square test

TRIALS = 200_000  # as the harness's own cases (tests/cloud_verifier/test_verify_stats.py)
CHAIN = SHAPES["chain"]  # ⟨1,1,1⟩: one draw at every node, three output tokens measured
PAIRS = Shape("pairs", ((2, 2),), 2, 27)  # two draws at every node: rrs tests the second one too
SHAPE = {"mss": CHAIN, "rrs": PAIRS}


def _draws(shape: Shape) -> int:
    """The draws at every node of a shape whose levels all draw alike (the table is per token)."""
    (ks,) = shape.expansions
    assert len(set(ks)) == 1
    return ks[0]


def saguaro_table(weights: torch.Tensor, sg: Saguaro, draws: int) -> torch.Tensor:
    """The draft table [V, V] (u16 weights) with every row as the edge ships it: `Saguaro.apply`."""
    out = torch.zeros_like(weights)
    for ctx in range(weights.shape[0]):
        w = weights[ctx].numpy()
        ids = np.flatnonzero(w)
        q = sg.apply(SparseDist.from_weights(ids, w[ids]), draws)
        out[ctx, torch.from_numpy(q.ids.astype(np.int64))] = torch.from_numpy(q.weights)
    return out


def saguaro_pair(pair: Pair, c: float, draws: int) -> Pair:
    return Pair(pair.target, (saguaro_table(pair.drafts[0], Saguaro(c), draws), *pair.drafts[1:]))


def run(mode: str, c: float, ship_unscaled: bool, monkeypatch: pytest.MonkeyPatch, seed: int) -> float:
    """p-value of the joint output of `mode` with Saguaro sampling at `c` against the target alone.
    ship_unscaled: the wrong variant (draws from the scaled rows, the draft's own rows shipped)."""
    shape = SHAPE[mode]
    pair = pair_for(shape)
    sag = saguaro_pair(pair, c, _draws(shape))
    assert not torch.equal(sag.drafts[0], pair.drafts[0])  # C changes the rows
    assert bool((sag.drafts[0].sum(-1) == Q_TOTAL).all())
    if ship_unscaled:
        own = pair.drafts[0]
        row_parent, _ = rows_of(ExpansionConfig(shape.expansions[0]).parents())

        def draw_shipping_own(
            p: Pair, sh: Shape, kind: str, root: torch.Tensor, gen: torch.Generator
        ) -> Round:
            rnd = draw_round(p, sh, kind, root, gen)  # drawn from the scaled rows
            ctx = torch.cat([root.unsqueeze(1), rnd.drafted[0]], 1)[:, torch.from_numpy(row_parent + 1)]
            return dataclasses.replace(rnd, q_probs=own[ctx].float() / Q_TOTAL)

        monkeypatch.setattr(harness, "draw_round", draw_shipping_own)
    params = SamplingParams(1.0)
    out = simulate(mode, sag, shape, params, TRIALS, seed)
    expected = joint_probs(reference_probs(pair, params), START_TOKEN, shape.measure)
    return chi2_pvalue(out.counts, expected)


@pytest.mark.parametrize("c", [0.5, 0.25])
@pytest.mark.parametrize("mode", ["mss", "rrs"])
def test_saguaro_sampling_keeps_the_target_distribution(
    mode: str, c: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    p = run(mode, c, ship_unscaled=False, monkeypatch=monkeypatch, seed=int(c * 100) + len(mode))
    assert p >= ALPHA, f"{mode} with Saguaro C={c} is exact but p = {p:.3g}"


@pytest.mark.parametrize("c", [0.5, 0.25])
@pytest.mark.parametrize("mode", ["mss", "rrs"])
def test_scaling_the_draws_but_not_the_shipped_q_is_rejected(
    mode: str, c: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    p = run(mode, c, ship_unscaled=True, monkeypatch=monkeypatch, seed=7)
    assert p < ALPHA, f"{mode}: C applied to drafting but not to the shipped q passed (p = {p:.3g})"


def test_the_harness_round_ships_the_rows_it_draws_from() -> None:
    """The premise of the wrong variant: unpatched, the harness ships the rows of the table it
    drew from, so the scaled table is what the verifier gets in the exact cases."""
    pair = saguaro_pair(pair_for(CHAIN), 0.25, 1)
    gen = torch.Generator().manual_seed(3)
    root = torch.randint(0, pair.vocab, (50,), generator=gen)
    rnd = draw_round(pair, CHAIN, "replacement", root, gen)
    assert rnd.q_probs is not None
    row_parent, _ = rows_of(ExpansionConfig(CHAIN.expansions[0]).parents())
    ctx = torch.cat([root.unsqueeze(1), rnd.drafted[0]], 1)[:, torch.from_numpy(row_parent + 1)]
    assert torch.equal(rnd.q_probs * Q_TOTAL, pair.drafts[0][ctx].float())


def _cached_bonus_share(c: float, trials: int = 40_000) -> tuple[float, float]:
    """One mss draw at the root, from the Saguaro row at `c` (1: the draft's own): the share of
    rounds that reject it, and the share of those whose bonus is one of the 3 likeliest tokens of
    the draft's q other than the drafted one (the bonus candidates pre-speculation caches)."""
    one = Shape("one", ((1,),), 1, 27)
    pair = pair_for(one)
    drafted_from = saguaro_pair(pair, c, 1) if c < 1 else pair
    gen = torch.Generator().manual_seed(11)
    root = torch.randint(0, pair.vocab, (trials,), generator=gen)
    rnd = draw_round(drafted_from, one, "replacement", root, gen)
    logits = pair.target[torch.cat([root.unsqueeze(1), rnd.tokens], 1)]
    batch = rnd.batch(np.full(trials, START_LEN, dtype=np.int64))
    res = verify_batch(Algorithm("mss"), batch, logits, SamplingParams(1.0), generator=gen)
    rejected = res.num_accepted == 0
    top = torch.argsort(-pair.drafts[0][root], dim=-1, stable=True)[:, :4]  # the draft's top 4
    others = top != rnd.tokens[:, :1]
    rank = others.cumsum(-1)  # the candidates: the first 3 of the top 4 that were not drafted
    cached = ((top == res.bonus.unsqueeze(1)) & others & (rank <= 3)).any(-1)
    return float(rejected.double().mean()), float(cached[rejected].double().mean())


def test_saguaro_sampling_moves_the_bonus_onto_the_cached_candidates() -> None:
    """What C is for: after a rejection the bonus is one of the candidates pre-speculation caches
    more often the smaller C (at the price of more rejections)."""
    (rej1, hit1), (rej5, hit5), (rej25, hit25) = (_cached_bonus_share(c) for c in (1.0, 0.5, 0.25))
    assert hit1 + 0.05 < hit5 and hit5 + 0.05 < hit25, (hit1, hit5, hit25)
    assert rej1 < rej5 < rej25, (rej1, rej5, rej25)
