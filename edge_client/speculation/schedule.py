"""The outcome cache's drafting schedule: which further outcomes to pre-speculate, and how deep.

While a round is in flight the edge has until its verdict is due to draft conditional trees. The
likeliest outcome gets a tree of the full shape, drafted alone (speculation.core). The time left
then goes to further outcomes, drafted as chains, all together: evaluation l of the schedule
holds one row for every chain still growing, so a schedule is a non-increasing list of rows per
evaluation r_0 >= r_1 >= ... and chain j (outcomes by odds, most likely first) gets depth
d_j = #{l : r_l > j}. On a CPU one evaluation of n rows costs about a + b n with a large a (the
weights are read once per evaluation), so covering more outcomes at a level is cheap and every
extra level is dear: the schedule is planned against the drafter's measured cost per evaluation
of n rows (DrafterStats.eval_ms), not per node.

Value. A hit with a chain of depth d verifies that chain at once: tokens(d) = 1 + alpha + ... +
alpha^d tokens in verify_ms(d). A miss costs `miss_ms_per_token` per token (the miss path's round,
speculation.backup). Covering outcome j with depth d saves

    P_j * (tokens(d) * miss_ms_per_token - verify_ms(d))        (g(d); g(0) = 0)

and the value is additive over evaluations: evaluation l adds P_j * (g(l + 1) - g(l)) for every
chain j it grows. The knapsack "most value within the time left" is solved with a Lagrange
multiplier: for a price lam per ms, each evaluation takes the rows r maximising
(g(l + 1) - g(l)) * (P_0 + ... + P_{r-1}) - lam * eval_ms(r); with diminishing gains per level
(g is replaced by its concave majorant) these rows do not increase with l, and lam is bisected to
the smallest price whose schedule fits.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from edge_client.speculation.estimates import verify_ms


@dataclass(frozen=True)
class Schedule:
    """Rows of each evaluation, each outcome's chain depth (0: not drafted), the time and value."""

    rows: tuple[int, ...]
    depths: tuple[int, ...]
    ms: float
    value: float


def chain_gains(
    alpha: float, depth: int, miss_ms_per_token: float, verify_cost_ms: Mapping[int, float]
) -> np.ndarray:
    """[depth + 1] g(d) for d = 0..depth (see the module docstring)."""
    d = np.arange(0, depth + 1, dtype=np.float64)
    tokens = 1.0 + np.concatenate([[0.0], np.cumsum(alpha ** d[1:])])
    v = verify_ms(verify_cost_ms, np.maximum(d, 1.0))
    g: np.ndarray = tokens * miss_ms_per_token - v
    g[0] = 0.0
    return g


def concave(g: np.ndarray) -> np.ndarray:
    """The least concave majorant of g(0..D) (its upper hull): gains per level that never grow.
    A first level worth less than the ones after it (a depth-1 chain may not pay for its
    verification where a depth-3 one does) is valued as the average slope to the better depth."""
    g = np.asarray(g, dtype=np.float64)
    hull: list[int] = []
    for d in range(g.size):
        while len(hull) >= 2:
            a, b = hull[-2], hull[-1]
            # b lies on or below the segment a..d: drop it
            if (g[b] - g[a]) * (d - a) <= (g[d] - g[a]) * (b - a):
                hull.pop()
            else:
                break
        hull.append(d)
    out: np.ndarray = np.interp(np.arange(g.size), hull, g[hull])
    return out


def _rows_at(lam: float, dg: np.ndarray, prefix: np.ndarray, cost: np.ndarray) -> list[int]:
    """For price lam: the best rows of every evaluation, forced non-increasing."""
    rows: list[int] = []
    cap = len(prefix) - 1
    for step in dg:
        score = step * prefix[: cap + 1] - lam * cost[: cap + 1]
        r = int(np.argmax(score)) if step > 0 else 0
        rows.append(r)
        cap = r
        if r == 0:
            break
    while rows and rows[-1] == 0:
        rows.pop()
    return rows


def plan_chains(
    probs: Sequence[float],
    gains: np.ndarray,
    eval_ms: Callable[[int], float],
    budget_ms: float,
) -> Schedule:
    """The schedule of most value that fits `budget_ms` (see the module docstring).

    probs:   the outcomes' odds, most likely first
    gains:   g(0..D) (chain_gains); chains are at most D deep
    eval_ms: the drafter's ms for one evaluation of n rows (n >= 1)
    """
    p = np.asarray(probs, dtype=np.float64)
    if p.size == 0 or budget_ms <= 0 or len(gains) < 2:
        return Schedule((), (0,) * p.size, 0.0, 0.0)
    if np.any(np.diff(p) > 1e-12):
        raise ValueError("plan_chains needs the outcomes most likely first")
    prefix = np.concatenate([[0.0], np.cumsum(p)])
    cost = np.asarray([0.0] + [eval_ms(n) for n in range(1, p.size + 1)], dtype=np.float64)
    dg = np.diff(concave(np.asarray(gains, dtype=np.float64)))

    def total(rows: list[int]) -> float:
        return float(sum(cost[r] for r in rows))

    lo, hi = 0.0, 1.0
    while total(_rows_at(hi, dg, prefix, cost)) > budget_ms and hi < 1e12:
        hi *= 4.0
    if total(_rows_at(lo, dg, prefix, cost)) <= budget_ms:
        hi = lo
    for _ in range(40):
        if hi - lo <= 1e-9 * max(1.0, hi):
            break
        mid = (lo + hi) / 2
        if total(_rows_at(mid, dg, prefix, cost)) <= budget_ms:
            hi = mid
        else:
            lo = mid
    rows = _rows_at(hi, dg, prefix, cost)
    depths = tuple(sum(1 for r in rows if r > j) for j in range(p.size))
    value = float(sum(dg[level] * prefix[r] for level, r in enumerate(rows)))
    return Schedule(tuple(rows), depths, total(rows), value)


__all__ = ["Schedule", "chain_gains", "concave", "plan_chains"]
