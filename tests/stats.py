"""The chi-square helper of the statistical tests (it lives in cloud_verifier.exactness.stats); a
test that calls it skips cleanly where scipy is not installed."""

from __future__ import annotations

import numpy as np
import pytest

from cloud_verifier.exactness import stats


def chi2_pvalue(observed: np.ndarray, expected_probs: np.ndarray, min_expected: float = 5.0) -> float:
    pytest.importorskip("scipy")
    return stats.chi2_pvalue(observed, expected_probs, min_expected)


__all__ = ["chi2_pvalue"]
