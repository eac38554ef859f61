"""The landing model of coupled drafting (trees.sampling.Landing, Coupling.rank): where the target's
token lands after it missed the coupled one, how its scale is learned, and what the builder and
the outcome model make of it."""

from __future__ import annotations

import numpy as np
import pytest

from edge_client.speculation.estimates import ChoiceModel
from edge_client.trees import Coupling, DraftOptions, draft_static, finish_leaves
from edge_client.trees.sampling import (
    Landing,
    LandingRow,
    landing_shares,
    softmax,
    top_logp,
)
from shared.keyed import BELOW_ONE, keyed_uniform
from shared.tree import ExpansionConfig
from tests.edge_client.fake_drafter import FakeDrafter, fake_logits

V = 64
S = [3, 14, 15, 9, 26, 5]

T = 0.7


def _target(p: np.ndarray, seed: int, pos: int) -> int:
    """The verifier's keyed draw from p (inverse CDF in token-id order, cloud_verifier.sampling)."""
    cdf = np.cumsum(p)
    u = keyed_uniform(seed, pos)
    return min(int(np.searchsorted(cdf, min(u * cdf[-1], cdf[-1] * BELOW_ONE), side="right")), p.size - 1)


def _pair(rng: np.random.Generator, v: int, noise: float) -> tuple[np.ndarray, np.ndarray]:
    """Draft logits and a target's p at T close to the draft's q_T (the logits perturbed)."""
    logits = (rng.normal(0, 2.5, v) + 6 * (rng.random(v) < 0.02)).astype(np.float32)
    p = softmax((logits.astype(np.float64) + rng.normal(0, noise, v)) / T)
    return logits, p


# ---------------------------------------------------------------- the model itself


def test_shares_are_a_distribution_over_the_row_outside_the_coupled_token() -> None:
    """Over every other token of the row the shares sum to 1 whatever sigma; a small sigma puts
    the mass on the coupled token's two neighbours in the CDF, a large one spreads it."""
    rng = np.random.default_rng(1)
    q = rng.dirichlet(np.full(40, 5.0))  # no token narrower than sigma 1e-4
    cdf = np.r_[0.0, np.cumsum(q)]
    u, c = 0.37, int(np.searchsorted(np.cumsum(q), 0.37, side="right"))
    others = np.r_[0:c, c + 1 : 40]
    lo, hi = cdf[others] - u, cdf[others + 1] - u
    left, right = u - cdf[c], cdf[c + 1] - u
    for sigma in (1e-4, 0.01, 0.1, 1.0):
        s = landing_shares(lo, hi, left, right, u, sigma)
        assert s.min() >= 0 and s.sum() == pytest.approx(1.0, abs=1e-9)
    tight = landing_shares(lo, hi, left, right, u, 1e-4)
    near = {int(np.flatnonzero(others == c - 1)[0]), int(np.flatnonzero(others == c + 1)[0])}
    assert set(np.argsort(-tight)[:2].tolist()) == near
    assert tight[sorted(near)].sum() > 0.999
    wide = landing_shares(lo, hi, left, right, u, 1.0)
    assert wide.max() < 0.5 and (wide > 1e-3).sum() > 10
    # one grid call gives every sigma's shares at once
    grid = landing_shares(lo, hi, left, right, u, np.asarray([1e-4, 0.1]))
    np.testing.assert_allclose(grid[0], tight)
    np.testing.assert_allclose(grid[1], landing_shares(lo, hi, left, right, u, 0.1))


def test_rank_leads_with_the_coupled_token_and_records_its_candidates() -> None:
    rng = np.random.default_rng(2)
    c = Coupling(seed=5, temperature=T)
    for pos in range(30):
        logits, _ = _pair(rng, 800, 0.0)
        r = c.rank(logits, 6, pos)
        assert int(r.ids[0]) == c.token(logits, pos)
        assert r.ids.size == 6 and len(set(r.ids.tolist())) == 6
        q = softmax(logits.astype(np.float64) / T)
        assert r.probs[0] == pytest.approx(q[r.ids[0]])
        assert float(r.probs.sum()) <= 1.0 + 1e-9
        lse = np.log(np.exp(logits.astype(np.float64) - logits.max()).sum()) + logits.max()
        np.testing.assert_allclose(r.logp, logits[r.ids].astype(np.float64) - lse, rtol=1e-6)
        # the row: the coupled token's interval straddles u, the candidates' are where q's CDF puts them
        row = r.row
        cdf = np.r_[0.0, np.cumsum(q)]
        np.testing.assert_allclose(row.lo, cdf[row.tokens] - row.u, atol=1e-9)
        np.testing.assert_allclose(row.hi, cdf[row.tokens + 1] - row.u, atol=1e-9)
        assert row.lo[0] <= 0 < row.hi[0]
        # the candidates after it, best first by the landing model
        shares = row.shares(c.landing.sigma)
        assert np.all(np.diff(shares[: r.ids.size - 1]) <= 1e-12)
        assert row.tokens[: r.ids.size].tolist() == r.ids.tolist()


def test_rank_keeps_to_the_truncated_row() -> None:
    """With top-k the CDF is over the kept tokens only: no candidate outside them."""
    rng = np.random.default_rng(3)
    c = Coupling(seed=9, temperature=T, top_k=12)
    for pos in range(20):
        logits, _ = _pair(rng, 500, 0.0)
        kept = set(top_logp(logits, 12)[0].tolist())
        r = c.rank(logits, 8, pos)
        assert int(r.ids[0]) == c.token(logits, pos)
        assert set(r.row.tokens.tolist()) <= kept


def test_after_a_mismatch_the_target_is_near_the_top_of_the_landing_order() -> None:
    """A target whose p is the draft's q_T perturbed: where it misses the coupled token, its token
    is the first candidate of the landing order far more often than of the draft's most likely
    order (which knows nothing of u), and in the first three most of the time (measured: first
    0.43 against 0.21, first three 0.78 against 0.49)."""
    rng = np.random.default_rng(4)
    c = Coupling(seed=11, temperature=T)
    landing_rank, draft_rank = [], []
    for pos in range(600):
        logits, p = _pair(rng, 1000, 0.2)
        r = c.rank(logits, 4, pos)
        tok = _target(p, 11, pos)
        if tok == int(r.ids[0]):
            continue
        after = r.ids[1:].tolist()
        landing_rank.append(after.index(tok) if tok in after else 3)
        top = [int(t) for t in top_logp(logits, 4)[0] if int(t) != int(r.ids[0])][:3]
        draft_rank.append(top.index(tok) if tok in top else 3)
        c.landing.observe(r.row, tok)
    lr, dr = np.asarray(landing_rank), np.asarray(draft_rank)
    assert lr.size > 50
    assert (lr < 1).mean() > 1.5 * (dr < 1).mean()
    assert (lr < 3).mean() > 0.7 and (lr < 3).mean() > (dr < 3).mean() + 0.2


def _shifted_rows(sigma: float, n: int, seed: int) -> list[tuple[LandingRow, int]]:
    """Rows whose target lands, by construction, at u + e in q's CDF with e ~ Laplace(sigma)
    (misses of the coupled token only), as a row's candidates recorded by Coupling.rank."""
    rng = np.random.default_rng(seed)
    c = Coupling(seed=seed, temperature=T)
    c.landing.adopt(Landing(prior_sigma=sigma, prior_spread=0.01))  # record candidates wide enough
    out: list[tuple[LandingRow, int]] = []
    pos = 0
    while len(out) < n:
        pos += 1
        logits, _ = _pair(rng, 600, 0.0)
        r = c.rank(logits, 4, pos)
        row = r.row
        at = row.u + rng.laplace(0, sigma)
        if not 0 <= at < 1 or row.lo[0] + row.u <= at < row.hi[0] + row.u:
            continue
        q = softmax(logits.astype(np.float64) / T)
        tok = min(int(np.searchsorted(np.cumsum(q), at, side="right")), q.size - 1)
        out.append((row, tok))
    return out


@pytest.mark.parametrize("sigma", [0.004, 0.04])
def test_sigma_is_learned_from_the_mismatches(sigma: float) -> None:
    """From the prior (0.03) the learned sigma moves to the scale the targets land at."""
    landing = Landing()
    for row, tok in _shifted_rows(sigma, 300, 7):
        landing.observe(row, tok)
    assert landing.seen > 30
    assert sigma / 2 < landing.sigma < sigma * 2


def test_a_match_teaches_nothing() -> None:
    landing = Landing()
    row, _ = _shifted_rows(0.01, 1, 3)[0]
    landing.observe(row, int(row.tokens[0]))
    assert landing.seen == 0 and landing.sigma == pytest.approx(Landing().sigma)


# ---------------------------------------------------------------- trees and the outcome model


def test_coupled_trees_rank_and_record_by_the_landing_model() -> None:
    c = Coupling(seed=3, temperature=T)
    cfg = ExpansionConfig((3, 2, 1))
    opts = DraftOptions(mode="match", coupling=c, eval_leaves=True)
    dr = draft_static(FakeDrafter(V), S, cfg, opts)
    tree = dr.tree
    assert dr.landing is c.landing
    for row in range(tree.num_nodes + 1):
        j = row - 1
        path = [int(tree.tokens[i]) for i in tree.path(j)] if j >= 0 else []
        r = c.rank(fake_logits(S + path, V), 4, len(S) + len(path))
        assert dr.alt_tokens[row].tolist() == r.ids.tolist()
        np.testing.assert_allclose(dr.alt_probs[row], r.probs, rtol=1e-6)
        kids = [int(tree.tokens[k]) for k in tree.children_of(j)]
        assert kids == r.ids[: len(kids)].tolist()  # children: the coupled token, then the landing order
        assert dr.landing_rows[row].tokens.tolist()[:4] == r.ids.tolist()
    # leaves finished later are recorded the same way
    d = FakeDrafter(V)
    late = finish_leaves(d, draft_static(d, S, cfg, opts.replace(eval_leaves=False)), opts)
    assert late.alt_tokens.tolist() == dr.alt_tokens.tolist()
    assert sorted(late.landing_rows) == sorted(dr.landing_rows)


def test_the_choice_model_reads_the_landing_shares_and_teaches_the_coupling() -> None:
    """Coupled rows: the runners-up get (1 - alpha) times the landing model's P(x | miss) (beta 1);
    a verdict that misses the coupled token teaches the choice model's landing, and the tree's
    coupling takes the learned state for the next trees."""
    c = Coupling(seed=4, temperature=T)
    dr = draft_static(FakeDrafter(V), S, ExpansionConfig((2, 1)), DraftOptions(mode="match", coupling=c))
    model = ChoiceModel(temperature=0.0)
    pi = model.choice(dr.alt_tokens[0], dr.alt_probs[0], False)
    row = dr.landing_rows[0]
    share = row.shares(c.landing.sigma)[:3]
    assert pi[int(dr.alt_tokens[0][0])] == pytest.approx(model.alpha)
    got = [pi[int(t)] for t in dr.alt_tokens[0][1:]]
    np.testing.assert_allclose(got, (1 - model.alpha) * share, rtol=1e-4)
    # the target took the candidate after the coupled token at row 0: a miss there
    second = int(dr.alt_tokens[0][1])
    assert second == int(dr.tree.tokens[1])
    before = model.landing.loglik.copy()
    model.observe(dr, [1], [second, 5])
    assert model.landing.seen > 0 and not np.array_equal(model.landing.loglik, before)
    assert c.landing is not model.landing
    np.testing.assert_array_equal(c.landing.loglik, model.landing.loglik)
    assert c.landing.sigma == model.landing.sigma


def test_budget_and_merged_trees_carry_the_landing_records() -> None:
    """A coupled dynamic (budget) tree ranks and records its rows by the landing model too, and a
    merged tree keeps its first drafter's records (its nodes keep their indices there)."""
    from edge_client.trees import draft_dynamic
    from edge_client.trees.merged import merge_drafts

    c = Coupling(seed=3, temperature=T)
    opts = DraftOptions(mode="match", coupling=c)
    dyn = draft_dynamic(FakeDrafter(V), S, 8, opts)
    assert dyn.landing is c.landing and dyn.landing_rows
    for row, rec in dyn.landing_rows.items():
        j = row - 1
        path = [int(dyn.tree.tokens[i]) for i in dyn.tree.path(j)] if j >= 0 else []
        r = c.rank(fake_logits(S + path, V), dyn.alt_tokens.shape[1], len(S) + len(path))
        assert dyn.alt_tokens[row].tolist() == r.ids.tolist()
        np.testing.assert_allclose(dyn.alt_probs[row], r.probs, rtol=1e-6)
        assert rec.tokens.tolist()[: len(r.ids)] == r.ids.tolist()
    first = draft_static(FakeDrafter(V), S, ExpansionConfig((2, 1)), opts)
    other = draft_static(FakeDrafter(V), S, ExpansionConfig((1, 1, 1)), opts)
    merged = merge_drafts([first, other])
    assert merged.landing is first.landing and merged.landing_rows == first.landing_rows
