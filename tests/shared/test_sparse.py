from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared import Q_TOTAL, ErrorCode, ProtocolError, SparseDist, SparseRows
from tests.stats import chi2_pvalue

ALPHA = 1e-6


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.floats(0.0, 1.0), min_size=1, max_size=300).filter(lambda x: sum(x) > 0),
    st.integers(0, 50),
    st.floats(0.05, 1.0),
)
def test_quantized_rows_are_exact(probs: list[float], top_k: int, top_p: float) -> None:
    p = np.asarray(probs)
    d = SparseDist.from_probs(p, top_k=top_k, top_p=top_p)
    assert int(d.weights.sum()) == Q_TOTAL
    assert d.weights.min() >= 1
    assert np.all(np.diff(d.ids) > 0)
    assert np.all(p[d.ids] > 0)
    if top_k:
        assert len(d) <= top_k
    d.check(vocab_size=p.size)
    # the kept set is a top set: nothing dropped is more likely than something kept
    dropped = np.setdiff1d(np.flatnonzero(p > 0), d.ids)
    if dropped.size:
        assert p[dropped].max() <= p[d.ids].min()
    # each weight is within one unit of the proportional share (or the floor of 1)
    share = p[d.ids] / p[d.ids].sum() * Q_TOTAL
    assert np.all(np.abs(d.weights - share) <= np.maximum(2, len(d)))


def test_top_k_then_top_p() -> None:
    p = np.array([0.05, 0.4, 0.3, 0.2, 0.05])
    assert SparseDist.from_probs(p, top_k=2).ids.tolist() == [1, 2]
    # top-p 0.75 keeps 0.4 + 0.3 + 0.2 (0.7 < 0.75)
    assert SparseDist.from_probs(p, top_p=0.75).ids.tolist() == [1, 2, 3]
    assert SparseDist.from_probs(p, top_p=0.7).ids.tolist() == [1, 2]
    one = SparseDist.from_probs(p, top_k=1)
    assert one.ids.tolist() == [1] and one.weights.tolist() == [Q_TOTAL]
    assert one.prob(1) == 1.0 and one.prob(0) == 0.0


def test_bad_rows_are_refused() -> None:
    with pytest.raises(ProtocolError) as info:
        SparseDist.from_weights([1, 2], [Q_TOTAL, 0])
    assert info.value.code is ErrorCode.BAD_DISTRIBUTION
    with pytest.raises(ProtocolError):
        SparseDist.from_weights([2, 1], [Q_TOTAL // 2, Q_TOTAL // 2])
    with pytest.raises(ProtocolError):
        SparseDist.from_weights([1, 2], [Q_TOTAL // 2, Q_TOTAL // 2 - 1])
    with pytest.raises(ProtocolError):
        SparseDist.from_probs(np.array([0.5, np.nan]))
    with pytest.raises(ProtocolError):
        SparseDist.from_probs(np.array([0.0, 0.0]))
    with pytest.raises(ProtocolError) as info:
        SparseDist.from_weights([1, 40], [Q_TOTAL // 2, Q_TOTAL // 2]).check(vocab_size=20)
    assert info.value.code is ErrorCode.OUT_OF_RANGE
    rows = SparseRows(np.array([0, 1, 1]), np.array([3], np.int32), np.array([Q_TOTAL], np.int64))
    with pytest.raises(ProtocolError):  # empty row
        rows.check(20)


def _row(seed: int, k: int = 12) -> SparseDist:
    rng = np.random.default_rng(seed)
    p = rng.dirichlet(np.full(k, 0.7))
    return SparseDist.from_probs(p)


@pytest.mark.parametrize("seed", [0, 1])
def test_sampling_with_replacement_matches_weights(seed: int) -> None:
    d = _row(seed)
    rng = np.random.default_rng(100 + seed)
    draws = d.sample(rng, 200_000)
    counts = np.bincount(np.searchsorted(d.ids, draws), minlength=len(d))
    assert chi2_pvalue(counts, d.weights / Q_TOTAL) > ALPHA


def test_sampling_without_replacement_is_successive_sampling() -> None:
    d = _row(3, k=6)
    rng = np.random.default_rng(7)
    n = 60_000
    pairs = np.stack([d.sample_without_replacement(rng, 2) for _ in range(n)])
    assert np.all(pairs[:, 0] != pairs[:, 1])
    q = d.weights / Q_TOTAL
    idx = {int(t): i for i, t in enumerate(d.ids)}
    cells = list(itertools.permutations(range(len(d)), 2))
    expected = np.array([q[a] * q[b] / (1 - q[a]) for a, b in cells])
    cell_of = {c: i for i, c in enumerate(cells)}
    counts = np.zeros(len(cells))
    for a, b in pairs.tolist():
        counts[cell_of[(idx[a], idx[b])]] += 1
    assert chi2_pvalue(counts, expected) > ALPHA


def test_a_wrong_sampler_is_caught() -> None:
    """The same test rejects a sampler that moves 1% of the mass: the test has power."""
    d = _row(0)
    q = d.weights / Q_TOTAL
    wrong = q.copy()
    i, j = int(np.argmax(q)), int(np.argmin(q))
    wrong[i] -= 0.01
    wrong[j] += 0.01
    rng = np.random.default_rng(5)
    counts = np.bincount(rng.choice(len(d), size=200_000, p=wrong), minlength=len(d))
    assert chi2_pvalue(counts, q) < ALPHA


def test_seeded_sampling_is_deterministic() -> None:
    d = _row(9)
    a = d.sample(np.random.default_rng(1), 50)
    b = d.sample(np.random.default_rng(1), 50)
    assert np.array_equal(a, b)
    assert np.array_equal(
        d.sample_without_replacement(np.random.default_rng(2), 5),
        d.sample_without_replacement(np.random.default_rng(2), 5),
    )
