"""How many nodes a dynamic tree should have: the budget from the server's measured cost curve.

Model (docs/architecture.md §6). One round costs

    round_ms(N) = rtt_ms + draft_ms(N) + verify_ms(N),    draft_ms(N) = draft_fixed_ms + draft_ms_per_node * N

where verify_ms(N) is the forward cost the server advertises in `welcome.verify_cost_ms` ({N: ms},
measured at start-up), interpolated linearly between measured sizes. A round yields

    tokens(N) = 1 + sum of the N largest gains,

because the accepted nodes of a tree form one path, so the expected accepted length is the sum over
nodes of P(node accepted), and a best-first tree holds the nodes of highest P. A node's gain is
its draft path probability (DraftResult.gains()), scaled by a calibration factor that corrects the
draft's over- or under-confidence (`AcceptanceCalibration`), or a geometric prior before any
draft exists. The budget is the N that maximises tokens(N) / round_ms(N): more nodes while a node
costs little (a flat GPU curve), fewer where every node adds forward time (these CPUs).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np


def verify_ms(cost: Mapping[int, float], n: np.ndarray) -> np.ndarray:
    """Forward ms for n nodes [k] from the advertised curve: linear between points, flat below the
    smallest measured size (a forward never gets cheaper than that). n beyond the largest is not
    extrapolated; callers cap n at the largest measured size."""
    if not cost:
        raise ValueError("verify_cost_ms is empty: the server measured no forward sizes")
    xs = np.asarray(sorted(cost), dtype=np.float64)
    ys = np.asarray([cost[int(x)] for x in xs], dtype=np.float64)
    return np.interp(np.asarray(n, dtype=np.float64), xs, ys)


def geometric_gains(alpha: float, n: int) -> np.ndarray:
    """[n] gains of a chain whose every token is accepted with probability alpha: alpha^d.
    A prior for the first round; any tree has at least these gains for its best path."""
    return alpha ** np.arange(1, n + 1, dtype=np.float64)


def expected_tokens(gains: Sequence[float] | np.ndarray, n: int) -> float:
    """1 + the sum of the n largest gains (the bonus token always comes)."""
    g = np.sort(np.asarray(gains, dtype=np.float64))[::-1]
    return 1.0 + float(g[:n].sum())


def choose_budget(
    verify_cost_ms: Mapping[int, float],
    gains: Sequence[float] | np.ndarray,
    *,
    rtt_ms: float = 0.0,
    draft_ms_per_node: float = 0.0,
    draft_fixed_ms: float = 0.0,
    max_nodes: int | None = None,
    calibration: float = 1.0,
) -> int:
    """The node budget N maximising expected tokens per ms of round time (see the module docstring).

    gains: per-node acceptance estimates (any order); N never exceeds len(gains), the largest
    measured size in verify_cost_ms, or max_nodes (the server's limit).
    """
    g = np.sort(np.clip(np.asarray(gains, dtype=np.float64) * calibration, 0.0, 1.0))[::-1]
    limit = min(len(g), max(verify_cost_ms) if verify_cost_ms else 0)
    if max_nodes is not None:
        limit = min(limit, max_nodes)
    if limit < 1:
        return 1
    n = np.arange(1, limit + 1)
    tokens = 1.0 + np.cumsum(g[:limit])
    round_ms = rtt_ms + draft_fixed_ms + draft_ms_per_node * n + verify_ms(verify_cost_ms, n)
    rate = tokens / np.maximum(round_ms, 1e-9)
    return int(n[int(np.argmax(rate))])


def next_gains(alpha: float, cap: int, last: tuple[np.ndarray, np.ndarray, int] | None = None) -> np.ndarray:
    """Gains to size the next dynamic tree by: a geometric prior before any tree, else the last
    tree's nodes as the target accepts them (`last[0]`, their reach), what its frontier left out
    (`last[1]`) and a deeper chain below its depth (`last[2]`), so that a budget may grow past the
    last tree."""
    if last is None:
        return geometric_gains(alpha, cap)
    reach, frontier, depth = last
    deeper = alpha ** np.arange(depth + 1, depth + 1 + cap)
    return np.concatenate([reach, frontier, deeper])


@dataclass
class AcceptanceCalibration:
    """Ratio of tree tokens the target accepted to the draft's own estimate (sum of path probs),
    as an exponential moving average over rounds. Multiply gains by `factor` before budgeting."""

    factor: float = 1.0
    decay: float = 0.8  # weight of the past; 0.8 follows a change of text within ~5 rounds

    def update(self, expected_accepted: float, accepted: int) -> float:
        """Record one round: the draft expected `expected_accepted` tree tokens, `accepted` came."""
        if expected_accepted > 1e-6:
            ratio = min(accepted / expected_accepted, 4.0)
            self.factor = self.decay * self.factor + (1.0 - self.decay) * ratio
        return self.factor
