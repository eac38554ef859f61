"""The statistical exactness harness: every verification algorithm, batched over trials on the
production `verify_batch`, against the exact joint distribution of the target alone (Pearson
chi-square), with deliberately wrong variants that the same test must reject.

Support for the tests (tests/cloud_verifier/test_verify_stats.py) and the CLI
(`python -m bench.verify_exactness`), which both import it from here. `rounds`: the model pairs,
tree shapes and draft rounds; `cases`: the simulation, the wrong variants and the cases; `stats`:
the chi-square p-value (needs scipy, from the dev extra).
"""

from cloud_verifier.exactness.cases import (
    WRONG,
    Case,
    CaseResult,
    full_matrix,
    joint_probs,
    pair_for,
    reference_probs,
    run_case,
    simulate,
    tokens_per_round,
)
from cloud_verifier.exactness.rounds import ALPHA, SHAPES, UNSHARED, Pair, Round, Shape, draw_round, make_pair
from cloud_verifier.exactness.stats import chi2_pvalue

__all__ = [
    "ALPHA",
    "SHAPES",
    "UNSHARED",
    "WRONG",
    "Case",
    "CaseResult",
    "Pair",
    "Round",
    "Shape",
    "chi2_pvalue",
    "draw_round",
    "full_matrix",
    "joint_probs",
    "make_pair",
    "pair_for",
    "reference_probs",
    "run_case",
    "simulate",
    "tokens_per_round",
]
