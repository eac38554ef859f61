"""Whether a token tree is well formed and within limits (shared/tree.py has the definitions): the
checks every tree from the wire passes, each failure a ProtocolError naming the field."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from shared.errors import ErrorCode, ProtocolError

MAX_DRAFTERS = 256

if TYPE_CHECKING:
    from shared.tree import TokenTree


@dataclass(frozen=True)
class DrawLimits:
    """Bounds on the work a stochastic tree's draws may cost the verifier (advertised in
    `welcome.limits`). The rejection math is linear in draws and q ids but quadratic in the draws at
    one row (rrs compares each draw with the earlier ones), so every one of these is bounded."""

    max_draws: int = 256  # draws in one tree
    max_row_draws: int = 32  # draws at one parent (siblings drawn from one node's q rows)
    max_q_ids: int = 16384  # token ids in all q rows of one tree
    max_q_row: int = 4096  # token ids in one q row


def validate(
    tree: TokenTree,
    vocab_size: int,
    max_nodes: int,
    max_depth: int,
    *,
    stochastic: bool | None = None,
    without_replacement: bool = False,
    field: str = "tree",
    draw_limits: DrawLimits | None = None,
) -> None:
    """Raise ProtocolError (naming the field) unless this tree is well formed and within limits.

    stochastic: True requires draws, False forbids them, None accepts either.
    without_replacement: the draws of one group (parent, q row) must have distinct tokens.
    draw_limits: bounds on draws and q rows (default DrawLimits()).
    """
    tok, par = tree.tokens, tree.parents
    if tok.ndim != 1 or par.ndim != 1 or tok.size != par.size:
        raise ProtocolError(ErrorCode.BAD_TREE, "tokens and parents must have one length", f"{field}.parents")
    n = tok.size
    if n > max_nodes:
        raise ProtocolError(
            ErrorCode.LIMIT_EXCEEDED, f"{n} nodes is over the limit of {max_nodes}", f"{field}.tokens"
        )
    if n and (int(tok.min()) < 0 or int(tok.max()) >= vocab_size):
        raise ProtocolError(
            ErrorCode.OUT_OF_RANGE, f"token ids must be in [0, {vocab_size})", f"{field}.tokens"
        )
    if tree.cond.size and (int(tree.cond.min()) < 0 or int(tree.cond.max()) >= vocab_size):
        raise ProtocolError(
            ErrorCode.OUT_OF_RANGE, f"token ids must be in [0, {vocab_size})", f"{field}.cond"
        )
    if tree.base < 0:
        raise ProtocolError(ErrorCode.BAD_MESSAGE, "base must be >= 0", f"{field}.base")
    if tree.committed_len < 1:
        raise ProtocolError(
            ErrorCode.BAD_TREE,
            "base + len(cond) must be >= 1 (row 0 is a committed token)",
            f"{field}.base",
        )
    if n and (np.any(par < -1) or np.any(par >= np.arange(n))):
        bad = int(np.flatnonzero((par < -1) | (par >= np.arange(n)))[0])
        raise ProtocolError(
            ErrorCode.BAD_TREE,
            f"parents[{bad}] = {int(par[bad])} is not -1 or an earlier node",
            f"{field}.parents",
        )
    if n and tree.max_depth > max_depth:
        raise ProtocolError(
            ErrorCode.LIMIT_EXCEEDED,
            f"depth {tree.max_depth} is over the limit of {max_depth}",
            f"{field}.parents",
        )
    if stochastic is True and tree.draws is None:
        raise ProtocolError(ErrorCode.BAD_TREE, "this mode needs draws with q rows", f"{field}.draws")
    if stochastic is False and tree.draws is not None:
        raise ProtocolError(ErrorCode.BAD_TREE, "deterministic modes take no draws", f"{field}.draws")
    if tree.draws is None:
        if n:
            key = (par.astype(np.int64) + 1) * (vocab_size + 1) + tok
            if np.unique(key).size != n:
                raise ProtocolError(
                    ErrorCode.BAD_TREE,
                    "siblings of a deterministic tree must have distinct tokens",
                    f"{field}.tokens",
                )
        return
    _validate_draws(tree, vocab_size, without_replacement, f"{field}.draws", draw_limits or DrawLimits())


def _validate_draws(
    tree: TokenTree, vocab_size: int, without_replacement: bool, field: str, lim: DrawLimits
) -> None:
    d = tree.draws
    assert d is not None
    n = tree.num_nodes
    if not (d.node.ndim == d.drafter.ndim == d.qrow.ndim == 1) or not (
        d.node.size == d.drafter.size == d.qrow.size
    ):
        raise ProtocolError(
            ErrorCode.BAD_TREE, "node, drafter and qrow must have one length", f"{field}.node"
        )
    # the bounds on work come first, before anything that costs time in their size
    if d.node.size > lim.max_draws:
        raise ProtocolError(
            ErrorCode.LIMIT_EXCEEDED,
            f"{d.node.size} draws is over the limit of {lim.max_draws}",
            f"{field}.node",
        )
    q_lengths = np.diff(d.q.ptr) if d.q.ptr.ndim == 1 and d.q.ptr.size >= 1 else np.zeros(0)
    if d.q.ids.size > lim.max_q_ids:
        raise ProtocolError(
            ErrorCode.LIMIT_EXCEEDED,
            f"{d.q.ids.size} q ids is over the limit of {lim.max_q_ids}",
            f"{field}.q_ids",
        )
    if q_lengths.size and int(q_lengths.max()) > lim.max_q_row:
        raise ProtocolError(
            ErrorCode.LIMIT_EXCEEDED,
            f"a q row of {int(q_lengths.max())} ids is over the limit of {lim.max_q_row}",
            f"{field}.q_ptr",
        )
    if d.node.size and (int(d.node.min()) < 0 or int(d.node.max()) >= n):
        raise ProtocolError(ErrorCode.BAD_TREE, f"draw nodes must be in [0, {n})", f"{field}.node")
    per_row = np.bincount(tree.parents.astype(np.int64)[d.node] + 1, minlength=1)
    if int(per_row.max(initial=0)) > lim.max_row_draws:
        raise ProtocolError(
            ErrorCode.LIMIT_EXCEEDED,
            f"{int(per_row.max())} draws at one parent is over the limit of {lim.max_row_draws}",
            f"{field}.node",
        )
    if np.unique(d.node).size != n:
        raise ProtocolError(
            ErrorCode.BAD_TREE, "every node must come from at least one draw", f"{field}.node"
        )
    if d.drafter.size and (int(d.drafter.min()) < 0 or int(d.drafter.max()) >= MAX_DRAFTERS):
        raise ProtocolError(
            ErrorCode.BAD_MESSAGE, f"drafter ids must be in [0, {MAX_DRAFTERS})", f"{field}.drafter"
        )
    d.q.check(vocab_size, f"{field}.q")
    rows = d.q.num_rows
    if d.qrow.size and (int(d.qrow.min()) < 0 or int(d.qrow.max()) >= rows):
        raise ProtocolError(ErrorCode.BAD_TREE, f"q rows must be in [0, {rows})", f"{field}.qrow")
    if rows > max(d.node.size, 1) or (rows and np.unique(d.qrow).size != rows):
        raise ProtocolError(ErrorCode.BAD_TREE, "every q row must be used by a draw", f"{field}.qrow")
    parent_of_draw = tree.parents[d.node]
    # a q row is the draft distribution at ONE parent
    row_parent = np.full(rows, -2, dtype=np.int64)
    for r, p in zip(d.qrow.tolist(), parent_of_draw.tolist(), strict=True):
        if row_parent[r] == -2:
            row_parent[r] = p
        elif row_parent[r] != p:
            raise ProtocolError(ErrorCode.BAD_TREE, f"q row {r} is used at two parents", f"{field}.qrow")
    drawn = tree.tokens[d.node]
    if np.any(d.q.weight_of(d.qrow, drawn) == 0):
        raise ProtocolError(
            ErrorCode.BAD_DISTRIBUTION, "a drawn token has zero mass in its q row", f"{field}.qrow"
        )
    if without_replacement:
        key = d.qrow.astype(np.int64) * (vocab_size + 1) + drawn
        if np.unique(key).size != key.size:
            raise ProtocolError(
                ErrorCode.BAD_TREE,
                "draws of one q row must be distinct without replacement",
                f"{field}.node",
            )
