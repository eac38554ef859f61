"""The chi-square helper of the statistical tests (it lives in bench.stats, which bench imports)."""

from __future__ import annotations

from bench.stats import chi2_pvalue

__all__ = ["chi2_pvalue"]
