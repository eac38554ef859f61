"""The chi-square helper of the statistical tests (it lives in cloud_verifier.exactness.stats)."""

from __future__ import annotations

from cloud_verifier.exactness.stats import chi2_pvalue

__all__ = ["chi2_pvalue"]
