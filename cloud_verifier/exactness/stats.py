"""Pearson chi-square with pooling of small cells: the statistical tests and the exactness harness.
scipy (the dev extra) is imported on the first test, so the package imports without it."""

from __future__ import annotations

import numpy as np


def chi2_pvalue(observed: np.ndarray, expected_probs: np.ndarray, min_expected: float = 5.0) -> float:
    """p-value of observed counts against expected probabilities.

    Cells whose expected count is below `min_expected` are pooled into one cell (and dropped if the
    pooled cell is still too small). A cell with zero expected probability but observed counts gives
    p = 0: the sampler produced something impossible.
    """
    observed = np.asarray(observed, dtype=np.float64).ravel()
    p = np.asarray(expected_probs, dtype=np.float64).ravel()
    n = observed.sum()
    if np.any((p <= 0) & (observed > 0)):
        return 0.0
    expected = p / p.sum() * n
    small = expected < min_expected
    obs = list(observed[~small])
    exp = list(expected[~small])
    if small.any():
        pooled_e = expected[small].sum()
        pooled_o = observed[small].sum()
        if pooled_e >= min_expected:
            obs.append(pooled_o)
            exp.append(pooled_e)
        elif pooled_o > 3 * max(pooled_e, 1.0) + 10:
            return 0.0
    if len(obs) < 2:
        return 1.0
    o, e = np.asarray(obs), np.asarray(exp)
    e *= o.sum() / e.sum()
    from scipy import stats

    return float(stats.chisquare(o, e).pvalue)
