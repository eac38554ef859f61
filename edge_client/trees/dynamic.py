"""Dynamic shape: a best-first tree under a node budget (Sequoia / EAGLE-2 style)."""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from edge_client.drafters.base import Drafter, WorkspaceFullError
from edge_client.trees.builder import (
    DraftOptions,
    DraftResult,
    TreeBuilder,
    anchor_node,
    check_stop,
    evaluate_level,
)
from edge_client.trees.sampling import Coupling, coupling_for, draft_mode, ranked_alts
from shared.messages import Mode

_DEFAULT = DraftOptions()


def draft_dynamic(
    drafter: Drafter,
    committed: Sequence[int],
    budget: int,
    opts: DraftOptions = _DEFAULT,
    *,
    max_depth: int = 16,
    width: int = 16,
    branch: int = 4,
) -> DraftResult:
    """Best-first tree of `budget` nodes by draft path probability (deterministic modes only).

    A heap holds candidate children (the `branch` most likely tokens after every evaluated node),
    keyed by path log-probability. Sequential best-first would pop one candidate, evaluate it,
    push its children, and repeat: one drafter call per node. Here each round pops a BATCH and
    evaluates it in one call: the best candidate, then each next one while it would still win
    against the children of the batch's nodes, estimated as (best path prob in the batch) * m,
    m = the mean top-1 draft probability seen so far in this tree. A confident draft (m near 1)
    thus grows deep chains a level per call; an unsure one grows wide levels. At most `width`
    nodes per call; nodes at `max_depth` are not expanded. The final batch (filling the budget)
    is not evaluated unless `opts.eval_leaves`. `stop` and `coupling` as in draft_static; a coupled
    token is ranked as if it were the most likely one (the target samples it with probability
    about the draft's agreement rate, whatever its draft probability).

    Stochastic modes are refused: whether a node is expanded would depend on other nodes' draws,
    and MSS/RRS need draw counts fixed independently of drawing; use a static shape for them.
    """
    t0 = time.perf_counter()
    cond, eval_leaves = opts.cond, opts.eval_leaves
    check_growth(opts.mode, budget, width, branch, max_depth)
    m = draft_mode(opts.mode)
    if (drafter.num_nodes if opts.reuse_workspace else 0) + budget > drafter.max_nodes:
        raise WorkspaceFullError(
            f"a budget of {budget} nodes does not fit the drafter's workspace ({drafter.max_nodes} nodes, "
            f"{drafter.num_nodes} in use); lower the budget or raise max_nodes"
        )
    coupling = coupling_for(m, opts.coupling)
    at = len(committed) + len(cond)  # absolute position of the token after row 0
    evals = drafter.stats.extend_calls
    root_id, root_logits = anchor_node(drafter, committed, cond, opts.reuse_workspace)
    grow = BestFirst(opts.alternatives, branch, coupling, at, Growth(budget, width, max_depth, eval_leaves))
    acc = grow.acc
    grow.push_children(-1, root_logits)
    while grow.growing():
        leaves_room = drafter.max_leaves - drafter.num_leaves
        expand = grow.next_level()
        if len(expand) > leaves_room:  # cannot branch further: stop growing, keep the tree as is
            break
        check_stop(opts.stop)
        for node, logits in evaluate_level(drafter, acc, expand, root_id):
            grow.take(node, logits)
    evals = drafter.stats.extend_calls - evals
    return acc.result(committed, cond, root_id, False, grow.frontier(), t0, evals)


def check_growth(mode: Mode | str, budget: int, width: int, branch: int, max_depth: int) -> None:
    """ValueError for a stochastic mode or a size that is not positive."""
    m = draft_mode(mode)
    if m.stochastic:
        raise ValueError(f"dynamic trees are for greedy/match; mode {m.value} needs a static shape")
    if budget < 1 or width < 1 or branch < 1 or max_depth < 1:
        raise ValueError("budget, width, branch and max_depth must be positive")


@dataclass(frozen=True)
class Growth:
    """How far a dynamic tree grows: `budget` nodes, at most `width` a drafter call, nodes at
    `max_depth` not expanded, the last batch evaluated only with `eval_leaves`."""

    budget: int
    width: int
    max_depth: int
    eval_leaves: bool = False


class BestFirst:
    """A dynamic tree as it grows: its builder, the heap of candidate children keyed by path
    log-probability, and per node its depth and the path log-probability it was ranked by."""

    def __init__(
        self, alternatives: int, branch: int, coupling: Coupling | None, at: int, growth: Growth
    ) -> None:
        self.growth = growth
        self.alternatives = alternatives
        self.branch = branch
        self.coupling = coupling
        self.at = at  # absolute position of the token after row 0
        self.acc = TreeBuilder(alternatives)
        self.acc.landing = coupling.landing if coupling is not None else None
        self.heap: list[tuple[float, int, int, int, float]] = []  # (-path logp, order, parent, token, logp)
        self.top1: list[float] = []  # the draft's top-1 probability after every evaluated node
        self.depth: list[int] = []
        self.rank: list[float] = []  # per node: the path log-probability it was ranked by
        self.order = itertools.count()  # FIFO among equal path probabilities

    def growing(self) -> bool:
        """Candidates left and room in the budget."""
        return bool(self.heap) and len(self.acc.tokens) < self.growth.budget

    def next_level(self) -> list[int]:
        """Add the next batch (`pop_batch`) to the tree; those of its nodes to evaluate (none
        when the batch filled the budget, unless eval_leaves; never those at max_depth)."""
        g = self.growth
        batch = self.pop_batch(min(g.width, g.budget - len(self.acc.tokens)))
        full = len(self.acc.tokens) >= g.budget
        return [n for n in batch if g.eval_leaves or (not full and self.depth[n] < g.max_depth)]

    def take(self, node: int, logits: np.ndarray) -> None:
        """The logits after an evaluated node: its children become candidates (its alternatives
        only, at max_depth)."""
        if self.depth[node] < self.growth.max_depth:
            self.push_children(node, logits)
        else:
            self.set_alternatives(node, logits)

    def push_children(self, node: int, logits: np.ndarray) -> None:
        """Record the alternatives after `node` and push its `branch` likeliest children (a coupled
        token ranked as the most likely one)."""
        d = 0 if node < 0 else self.depth[node]
        ids, vals, probs, row = ranked_alts(
            logits, max(self.branch, self.alternatives), self.coupling, self.at + d
        )
        self.acc.set_alt(node + 1, ids, probs, row)
        best = float(vals.max())
        self.top1.append(math.exp(best))
        base = self.rank[node] if node >= 0 else 0.0
        top = zip(ids[: self.branch].tolist(), vals[: self.branch].tolist(), strict=True)
        for i, (tok, lp) in enumerate(top):
            rank_lp = best if self.coupling is not None and i == 0 else lp
            heapq.heappush(self.heap, (-(base + rank_lp), next(self.order), node, tok, lp))

    def set_alternatives(self, node: int, logits: np.ndarray) -> None:
        """Record the alternatives after a node that is not expanded (at max_depth)."""
        ids, _, probs, row = ranked_alts(logits, self.alternatives, self.coupling, self.at + self.depth[node])
        self.acc.set_alt(node + 1, ids, probs, row)

    def pop_batch(self, most: int) -> list[int]:
        """Add the next batch of at most `most` nodes to the tree: the best candidate, then each next
        one while it would still beat a child of the best one (its path probability times the mean
        top-1 probability so far); the new nodes."""
        log_m = math.log(max(sum(self.top1) / len(self.top1), 1e-9))
        batch: list[int] = []
        bar = -math.inf
        while self.heap and len(batch) < most and -self.heap[0][0] >= bar:
            neg, _, parent, tok, lp = heapq.heappop(self.heap)
            node = self.acc.add(parent, tok, lp)
            self.depth.append(1 if parent < 0 else self.depth[parent] + 1)
            self.rank.append(-neg)
            batch.append(node)
            if len(batch) == 1:
                bar = -neg + log_m  # a child of the best batch node would reach about this
        return batch

    def frontier(self) -> np.ndarray:
        """Descending path probabilities of the best 64 candidates left out."""
        return np.sort(np.exp(np.asarray([-h[0] for h in self.heap], dtype=np.float64)))[::-1][:64]
