"""The miss path (Saguaro's backup speculator): which tree to draft after a miss.

After a miss nothing is at the server: the edge drafts a tree synchronously, so its whole drafting
time is on the critical path, then the round trip and the verification follow. The configured
shape (say the static ⟨2,1,1,1,1,1,1,1⟩, drafted level by level) is the right tree when drafting
is cheap; with a slow drafter a shallow chain may give more tokens per ms of round. Each candidate
is priced with measured costs:

    round_ms(S) = draft_ms(S) + rtt_ms + verify_ms(nodes(S))
    draft_ms(S) = eval(1) (the bonus token's sync) + sum over the evaluated levels of eval(rows)
    tokens(S)   = 1 + expected accepted nodes

where eval(rows) is the drafter's running cost of one evaluation of that many rows
(DrafterStats.eval_ms), verify_ms the server's advertised cost curve (welcome.verify_cost_ms), a
tree's leaves are not evaluated before it is sent (a chain of depth d makes d evaluations with
the sync), and the expected accepted nodes come from the outcome model: alpha^1 + ... + alpha^d
for a chain (alpha: the odds the target takes the draft's top token), the calibrated reach of
the last tree of the configured shape for that shape. The candidate with the most tokens per ms
is drafted (`choose_backup`). The choice affects only speed: every tree is verified exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from edge_client.speculation.config import TreeSpec
from edge_client.speculation.estimates import verify_ms
from shared.tree import ExpansionConfig


@dataclass(frozen=True)
class Backup:
    """A miss-path candidate priced: its shape, nodes, expected tokens and times (ms)."""

    shape: TreeSpec
    nodes: int
    tokens: float
    draft_ms: float
    round_ms: float

    @property
    def rate(self) -> float:
        """Expected tokens per ms of round."""
        return self.tokens / max(self.round_ms, 1e-9)

    @property
    def label(self) -> str:
        if self.shape.kind == "sequence":
            return f"chain{self.shape.chain_depth}"
        if self.shape.kind == "budget":
            return f"budget{self.shape.budget}"
        return "tree"


def level_rows(expansion: ExpansionConfig) -> list[int]:
    """Nodes per level of a static tree (SpecInfer expansion: every node of level i has k_{i+1}
    children)."""
    out, width = [], 1
    for k in expansion.ks:
        width *= int(k)
        out.append(width)
    return out


def draft_ms_of(levels: list[int], eval_ms: Callable[[int], float]) -> float:
    """The sync of the bonus token, then one evaluation per level but the last (leaves are sent
    unevaluated)."""
    return eval_ms(1) + sum(eval_ms(n) for n in levels[:-1])


def choose_backup(
    full: TreeSpec,
    full_tokens: float,
    full_nodes: int,
    alpha: float,
    eval_ms: Callable[[int], float],
    verify_cost_ms: Mapping[int, float],
    rtt_ms: float,
    max_depth: int,
    full_draft_ms: float | None = None,
) -> tuple[Backup, list[Backup]]:
    """The miss-path tree with the most expected tokens per ms of round, and every candidate.

    full:          the configured shape (static or budget), with `full_tokens` expected tokens,
                   `full_nodes` nodes and, for a shape not drafted level by level (budget), its
                   measured drafting time `full_draft_ms`
    alpha:         the odds the target takes the draft's top token (estimates.ChoiceModel.alpha)
    eval_ms:       the drafter's ms for one evaluation of n rows
    verify_cost_ms: the server's forward ms by tree nodes
    max_depth:     the deepest chain considered (the server's max_depth)
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be a probability, got {alpha}")

    def priced(shape: TreeSpec, nodes: int, tokens: float, draft: float) -> Backup:
        v = float(verify_ms(verify_cost_ms, np.asarray([nodes]))[0])
        return Backup(shape, nodes, tokens, draft, draft + max(rtt_ms, 0.0) + v)

    if full.kind == "static":
        levels = level_rows(full.expansion)
        full_ms = draft_ms_of(levels, eval_ms)
    else:
        full_ms = full_draft_ms if full_draft_ms is not None else float("inf")
    options = [priced(full, full_nodes, full_tokens, full_ms)]
    deepest = min(max_depth, full.chain_depth if full.kind != "budget" else max_depth)
    gains = alpha ** np.arange(1, deepest + 1, dtype=np.float64)
    for d in range(1, deepest + 1):
        chain = TreeSpec("sequence", ExpansionConfig((1,) * d), depth=d)
        tokens = 1.0 + float(gains[:d].sum())
        options.append(priced(chain, d, tokens, draft_ms_of([1] * d, eval_ms)))
    best = max(options, key=lambda b: b.rate)
    return best, options


__all__ = ["Backup", "choose_backup", "draft_ms_of", "level_rows"]
