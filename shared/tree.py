"""Token trees: arrays, never node objects (docs/architecture.md §3).

The committed sequence S has length L; its last token is "row 0" of a verify forward (it was the
previous round's bonus and is not yet in the target's KV cache). Tree nodes are rows 1..N:

    tokens[i]   token id of node i
    parents[i]  -1 for a child of row 0, else an index < i (so node order is topological)
    depth[i]    1 for a child of row 0, else depth[parents[i]] + 1

A tree may be conditional: it assumes the committed sequence is `S[:base] + cond`, and node i sits at
absolute position `base + len(cond) + depth[i] - 1`. Node i attends to the cached prefix, row 0,
its ancestors and itself.

Deterministic trees (modes greedy, match) have distinct tokens among siblings. Stochastic trees
(mss, rrs) carry `draws`: an ordered list in which draw d made node `draws.node[d]` by sampling its
token from q row `draws.qrow[d]` at that node's parent. Draws at one parent are in draw order;
no operation reorders or drops a draw (the verifier applies the residual update once per draw), and
a merge may share a node between identical paths but keeps every draw. The draws at one parent
from one q row form a group; in mode rrs a group was drawn without replacement.

Whether a conditional tree matches the committed sequence S, and re-rooting one that S has grown
into, are in shared.tree_match.

The checks every tree from the wire passes (`validate_tree`, each failure a ProtocolError naming
the field) are at the end of this module.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from shared.errors import ErrorCode, ProtocolError
from shared.sparse import SparseRows

DEFAULT_EXPANSION = (1, 1, 3, 1, 1, 1, 1, 1)  # SpecInfer's default expansion config


def _i32(a: Sequence[int] | np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(a, dtype=np.int64).astype(np.int32))


@dataclass(frozen=True, eq=False)
class Draws:
    """The ordered draws of a stochastic tree.

    node:    [D] int32, the node made by draw d (its token was drawn at the node's parent)
    drafter: [D] int32 in [0, 256), which drafter drew it (merged trees hold several)
    qrow:    [D] int32, the row of `q` the draw was sampled from
    q:       the draft rows, CSR
    """

    node: np.ndarray
    drafter: np.ndarray
    qrow: np.ndarray
    q: SparseRows

    @property
    def num_draws(self) -> int:
        return int(self.node.size)


@dataclass(frozen=True, eq=False)
class TokenTree:
    """A token tree. tokens, parents: [N] int32; cond: [C] int32 (see the module docstring)."""

    tokens: np.ndarray
    parents: np.ndarray
    base: int = 0
    cond: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int32))
    draws: Draws | None = None

    # ----------------------------------------------------------------- construction
    @classmethod
    def build(
        cls,
        tokens: Sequence[int] | np.ndarray,
        parents: Sequence[int] | np.ndarray,
        base: int = 0,
        cond: Sequence[int] | np.ndarray = (),
        draws: Draws | None = None,
    ) -> TokenTree:
        return cls(_i32(tokens), _i32(parents), int(base), _i32(cond), draws)

    @classmethod
    def chain(cls, tokens: Sequence[int] | np.ndarray, base: int = 0, cond: Sequence[int] = ()) -> TokenTree:
        """A "sequence" draft: each node the child of the previous one."""
        n = len(tokens)
        return cls.build(tokens, np.arange(-1, n - 1), base, cond)

    @classmethod
    def from_sequences(
        cls, sequences: Iterable[Sequence[int]], base: int = 0, cond: Sequence[int] = ()
    ) -> TokenTree:
        """The deterministic tree (a trie) holding every sequence as a root-to-node path."""
        index: dict[tuple[int, int], int] = {}
        tokens: list[int] = []
        parents: list[int] = []
        for seq in sequences:
            parent = -1
            for tok in seq:
                key = (parent, int(tok))
                node = index.get(key)
                if node is None:
                    node = len(tokens)
                    index[key] = node
                    tokens.append(int(tok))
                    parents.append(parent)
                parent = node
        return cls.build(tokens, parents, base, cond)

    # ----------------------------------------------------------------- derived arrays
    @property
    def num_nodes(self) -> int:
        return int(self.tokens.size)

    @property
    def is_stochastic(self) -> bool:
        return self.draws is not None

    @cached_property
    def depth(self) -> np.ndarray:
        """[N] int32, 1 for children of row 0. Assumes parents[i] < i (see validate)."""
        depth = np.zeros(self.num_nodes, dtype=np.int32)
        par = self.parents.tolist()
        for i, p in enumerate(par):
            depth[i] = 1 if p < 0 else depth[p] + 1
        return depth

    @property
    def max_depth(self) -> int:
        return int(self.depth.max()) if self.num_nodes else 0

    @property
    def committed_len(self) -> int:
        """L, the committed length this tree assumes: base + len(cond)."""
        return self.base + int(self.cond.size)

    @property
    def positions(self) -> np.ndarray:
        """[N] int64 absolute positions: base + len(cond) + depth - 1."""
        return self.committed_len + self.depth.astype(np.int64) - 1

    @property
    def row0_position(self) -> int:
        """Absolute position of row 0 (the last committed token)."""
        return self.committed_len - 1

    @cached_property
    def children(self) -> list[list[int]]:
        """children[p + 1] lists the children of node p (p = -1: row 0) in node order."""
        out: list[list[int]] = [[] for _ in range(self.num_nodes + 1)]
        for i, p in enumerate(self.parents.tolist()):
            out[p + 1].append(i)
        return out

    def children_of(self, node: int) -> list[int]:
        """Children of `node` (-1 for row 0), in node order."""
        return self.children[node + 1]

    def ancestor_mask(self) -> np.ndarray:
        """[N, N] bool: mask[i, j] is True iff j is i or an ancestor of i."""
        n = self.num_nodes
        mask = np.eye(n, dtype=bool)
        for i, p in enumerate(self.parents.tolist()):
            if p >= 0:
                mask[i] |= mask[p]
        return mask

    def row_mask(self) -> np.ndarray:
        """[N + 1, N + 1] bool over row 0 and the nodes: what each row attends to (besides the cache)."""
        n = self.num_nodes
        mask = np.zeros((n + 1, n + 1), dtype=bool)
        mask[:, 0] = True
        mask[1:, 1:] = self.ancestor_mask()
        return mask

    def path(self, node: int) -> list[int]:
        """Node indices from the depth-1 ancestor down to `node`."""
        out = []
        par = self.parents
        while node >= 0:
            out.append(node)
            node = int(par[node])
        return out[::-1]

    def path_tokens(self, node: int) -> list[int]:
        return [int(self.tokens[i]) for i in self.path(node)]

    def leaves(self) -> list[int]:
        has_child = np.zeros(self.num_nodes, dtype=bool)
        has_child[self.parents[self.parents >= 0]] = True
        return [int(i) for i in np.flatnonzero(~has_child)]

    def paths(self) -> set[tuple[int, ...]]:
        """The set of root-to-node token sequences (every prefix included)."""
        return {tuple(self.path_tokens(i)) for i in range(self.num_nodes)}

    def dfs_order(self) -> list[int]:
        """Pre-order depth-first traversal, siblings in node order."""
        out: list[int] = []
        stack = list(reversed(self.children_of(-1)))
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(reversed(self.children_of(node)))
        return out

    def draws_at(self, parent: int) -> list[int]:
        """Indices of the draws made at `parent` (-1: row 0), in draw order."""
        if self.draws is None:
            return []
        par_of_draw = self.parents[self.draws.node]
        return [int(d) for d in np.flatnonzero(par_of_draw == parent)]

    # ----------------------------------------------------------------- validation
    def validate(
        self,
        vocab_size: int,
        max_nodes: int,
        max_depth: int,
        *,
        stochastic: bool | None = None,
        without_replacement: bool = False,
        field: str = "tree",
        draw_limits: DrawLimits | None = None,
    ) -> None:
        """Raise ProtocolError (naming the field) unless this tree is well formed and within limits
        (shared/tree.py). stochastic: True requires draws, False forbids them, None
        accepts either. without_replacement: the draws of one group (parent, q row) must have
        distinct tokens. draw_limits: bounds on draws and q rows (default DrawLimits())."""
        validate_tree(
            self,
            vocab_size,
            max_nodes,
            max_depth,
            stochastic=stochastic,
            without_replacement=without_replacement,
            field=field,
            draw_limits=draw_limits,
        )


def merge(trees: Sequence[TokenTree]) -> TokenTree:
    """Merge token trees per SpecInfer Definition 3.2: the union of their root-to-node paths.

    Deterministic trees: identical paths become one node. Stochastic trees: a node is shared between
    identical paths but every draw is kept, the draws of earlier trees first, each tree's in its own
    order; q rows are concatenated. All trees must assume the same base and cond.
    """
    if not trees:
        raise ValueError("merge needs at least one tree")
    first = trees[0]
    stochastic = first.is_stochastic
    for t in trees[1:]:
        if t.base != first.base or not np.array_equal(t.cond, first.cond):
            raise ValueError("merged trees must assume the same base and cond")
        if t.is_stochastic != stochastic:
            raise ValueError("cannot merge a stochastic tree with a deterministic one")
    index: dict[tuple[int, int], int] = {}
    tokens: list[int] = []
    parents: list[int] = []
    d_node: list[np.ndarray] = []
    d_drafter: list[np.ndarray] = []
    d_qrow: list[np.ndarray] = []
    q_ptr: list[np.ndarray] = [np.zeros(1, dtype=np.int64)]
    q_ids: list[np.ndarray] = []
    q_w: list[np.ndarray] = []
    rows = 0
    nnz = 0
    for t in trees:
        remap = np.empty(t.num_nodes, dtype=np.int32)
        for i, (tok, p) in enumerate(zip(t.tokens.tolist(), t.parents.tolist(), strict=True)):
            parent = -1 if p < 0 else int(remap[p])
            key = (parent, tok)
            node = index.get(key)
            if node is None:
                node = len(tokens)
                index[key] = node
                tokens.append(tok)
                parents.append(parent)
            remap[i] = node
        if t.draws is not None:
            d = t.draws
            d_node.append(remap[d.node])
            d_drafter.append(d.drafter)
            d_qrow.append(d.qrow + rows)
            q_ptr.append(d.q.ptr[1:] + nnz)
            q_ids.append(d.q.ids)
            q_w.append(d.q.weights)
            rows += d.q.num_rows
            nnz += int(d.q.ids.size)
    draws = None
    if stochastic:
        draws = Draws(
            node=_i32(np.concatenate(d_node)),
            drafter=_i32(np.concatenate(d_drafter)),
            qrow=_i32(np.concatenate(d_qrow)),
            q=SparseRows(
                np.concatenate(q_ptr).astype(np.int64),
                np.concatenate(q_ids).astype(np.int32),
                np.concatenate(q_w).astype(np.int64),
            ),
        )
    return TokenTree.build(tokens, parents, first.base, first.cond, draws)


@dataclass(frozen=True)
class ExpansionConfig:
    """SpecInfer's expansion-based tree ⟨k1..km⟩: every node at depth i-1 gets k_i children."""

    ks: tuple[int, ...] = DEFAULT_EXPANSION

    def __post_init__(self) -> None:
        if not self.ks or any(k < 1 for k in self.ks):
            raise ValueError(f"an expansion config is a non-empty list of positive ints, got {self.ks}")

    @classmethod
    def parse(cls, text: str) -> ExpansionConfig:
        """From "1,1,3,1,1,1,1,1"."""
        try:
            ks = tuple(int(x) for x in text.replace(" ", "").split(",") if x)
        except ValueError as exc:
            raise ValueError(f"expansion config must be comma-separated positive ints, got {text!r}") from exc
        return cls(ks)

    @property
    def depth(self) -> int:
        return len(self.ks)

    @property
    def width(self) -> int:
        """Number of leaves: k1 * ... * km."""
        return int(np.prod(self.ks))

    @property
    def num_nodes(self) -> int:
        """sum over i of k1 * ... * ki."""
        return int(np.cumprod(self.ks).sum())

    def parents(self) -> np.ndarray:
        """[num_nodes] int32 parents of the full expansion, level by level, children in draw order."""
        parents: list[int] = []
        level = [-1]
        for k in self.ks:
            nxt = []
            for p in level:
                for _ in range(k):
                    nxt.append(len(parents))
                    parents.append(p)
            level = nxt
        return _i32(parents)

    def __str__(self) -> str:
        return "⟨" + ",".join(map(str, self.ks)) + "⟩"


# ---------------------------------------------------------------------------------------------------
# Validation: the checks every tree from the wire passes

MAX_DRAFTERS = 256


@dataclass(frozen=True)
class DrawLimits:
    """Bounds on the work a stochastic tree's draws may cost the verifier (advertised in
    `welcome.limits`). The rejection math is linear in draws and q ids but quadratic in the draws at
    one row (rrs compares each draw with the earlier ones), so every one of these is bounded."""

    max_draws: int = 256  # draws in one tree
    max_row_draws: int = 32  # draws at one parent (siblings drawn from one node's q rows)
    max_q_ids: int = 16384  # token ids in all q rows of one tree
    max_q_row: int = 4096  # token ids in one q row


def validate_tree(
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
