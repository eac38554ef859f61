"""The exactness harness's model pairs, tree shapes and draft rounds: a tiny bigram "model" pair
(target logits and draft q rows, each a random table indexed by the last token, so every row at
every depth is known) and the trees the edge would draft from q, batched over trials."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from cloud_verifier.verify import TreeBatch, draw_slots
from shared.sparse import Q_TOTAL, SparseDist, SparseRows
from shared.tree import Draws, ExpansionConfig, TokenTree, merge

ALPHA = 1e-6
START_TOKEN = 1  # the last committed token of every trial
START_LEN = 7  # committed length L at the start of every trial
CHUNK = 50_000  # trials simulated at once (bounds memory: logits are [chunk, N + 1, V])
# the tree each algorithm is verified on: deterministic (distinct siblings, no q), or the draws of a
# stochastic tree sampled with / without replacement
TREE_KIND = {
    "greedy": "distinct",
    "match": "distinct",
    "naive": "replacement",
    "mss": "replacement",
    "rrs": "without",
}


# --------------------------------------------------------------------------- model pairs, shapes
@dataclass(frozen=True)
class Pair:
    """A bigram target and its drafters over a tiny vocabulary."""

    target: torch.Tensor  # [V, V] float32, target logits of the next token given the last one
    drafts: tuple[torch.Tensor, ...]  # each [V, V] int64 u16 weights (rows sum to 2^16): q | last token

    @property
    def vocab(self) -> int:
        return int(self.target.shape[0])


def make_pair(vocab: int, seed: int) -> Pair:
    """A random target and two drafters correlated with it (the second truncated to top-k)."""
    rng = np.random.default_rng(seed)
    target = rng.normal(size=(vocab, vocab)) * 1.5
    drafts = []
    for d, top_k in enumerate((0, max(2, vocab // 2))):
        logits = 0.6 * target + rng.normal(size=(vocab, vocab)) * (0.8 + 0.4 * d)
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        w = np.zeros((vocab, vocab), dtype=np.int64)
        for row in range(vocab):
            q = SparseDist.from_probs(probs[row], top_k=top_k)
            w[row, q.ids] = q.weights
        drafts.append(torch.from_numpy(w))
    return Pair(torch.from_numpy(target.astype(np.float32)), tuple(drafts))


@dataclass(frozen=True)
class Shape:
    name: str
    expansions: tuple[tuple[int, ...], ...]  # one expansion config per drafter; two = a merged tree
    measure: int  # output tokens whose joint distribution is tested
    vocab: int
    share: bool = True  # duplicate draws share one node (as `merge` and the edge do); else one node each

    @property
    def merged(self) -> bool:
        return len(self.expansions) > 1


SHAPES = {
    "chain": Shape("chain", ((1, 1, 1),), 3, 12),
    "specinfer": Shape("specinfer", ((1, 1, 3),), 3, 12),
    "wide": Shape("wide", ((4, 1),), 2, 27),
    "merged": Shape("merged", ((2, 1), (2,)), 2, 27),  # leaves at depths 1 and 2
}
# the same wide root with duplicate draws kept as separate sibling nodes (also a valid tree)
UNSHARED = Shape("wide-unshared", ((4, 1),), 2, 27, share=False)


# --------------------------------------------------------------------------- the edge: draft trees
def _gumbel(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    return -torch.empty(shape, dtype=torch.float64).exponential_(generator=gen).log()


def draw_levels(
    weights: torch.Tensor, ks: Sequence[int], root: torch.Tensor, kind: str, gen: torch.Generator
) -> torch.Tensor:
    """One drafter's expansion tree per trial, as the edge draws it from its u16 rows.

    weights [V, V] int64; root [T] last committed tokens. Each node at depth i - 1 gets ks[i] children,
    drawn from q(. | its token) with replacement (inverse CDF on integer weights, as
    `SparseDist.sample`) or without (Gumbel-top-k, as `SparseDist.sample_without_replacement`).
    Returns tokens [T, n] in `ExpansionConfig.parents()` order.
    """
    level = root.unsqueeze(1)
    out = []
    log_w = weights.double().log() if kind != "replacement" else None
    cum = weights.cumsum(-1) if kind == "replacement" else None
    for k in ks:
        t, m = level.shape
        if cum is not None:
            r = torch.randint(0, Q_TOTAL, (t, m, k), generator=gen)
            idx = torch.searchsorted(cum[level], r, right=True)
        else:
            assert log_w is not None
            keys = log_w[level] + _gumbel((t, m, weights.shape[1]), gen)
            idx = torch.topk(keys, k, dim=-1).indices
        level = idx.reshape(t, m * k)
        out.append(level)
    return torch.cat(out, 1)


def rows_of(parents: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """q rows of an expansion tree: one per parent with children, in order (row 0: the root).
    Returns (parent of each row [R] (-1 = root), row of each node's draw [n])."""
    row_parent, qrow = np.unique(parents, return_inverse=True)
    return row_parent.astype(np.int64), qrow.astype(np.int32)


def _q_rows(
    weights: torch.Tensor, row_parent: np.ndarray, root: torch.Tensor, toks: torch.Tensor
) -> torch.Tensor:
    """q of each row per trial: weights [V, V]; root [T]; toks [T, n]. Returns [T, R, V] float32."""
    ctx = torch.cat([root.unsqueeze(1), toks], 1)[:, torch.from_numpy(row_parent + 1)]
    return weights[ctx].float() / Q_TOTAL


def _dummy_rows(n: int) -> SparseRows:
    return SparseRows.from_rows([SparseDist.from_weights([0], [Q_TOTAL])] * n)


def _sparse_rows(q: np.ndarray) -> SparseRows:
    """[R, V] float q rows (multiples of 2^-16) as CSR u16 rows."""
    rows = []
    for row in q:
        ids = np.flatnonzero(row)
        rows.append(SparseDist.from_weights(ids, np.rint(row[ids] * Q_TOTAL).astype(np.int64)))
    return SparseRows.from_rows(rows)


@dataclass(frozen=True)
class Round:
    """One round's trees for a batch of trials (TreeBatch without committed lengths)."""

    tokens: torch.Tensor  # [T, N]
    slots: torch.Tensor  # [T, N + 1, K]
    qrow: torch.Tensor | None  # [T, N + 1, K]
    q_probs: torch.Tensor | None  # [T, R, V]
    depth: int
    drafted: tuple[torch.Tensor, ...] = ()  # each drafter's own tree tokens [T, n_d], before merging

    def batch(self, committed_len: np.ndarray) -> TreeBatch:
        if self.q_probs is None:
            return TreeBatch(self.tokens, self.slots, committed_len, self.depth)
        t, r, v = self.q_probs.shape
        ids = torch.arange(v).expand(t, r, v)
        return TreeBatch(self.tokens, self.slots, committed_len, self.depth, self.qrow, ids, self.q_probs)


def draw_round(pair: Pair, shape: Shape, kind: str, root: torch.Tensor, gen: torch.Generator) -> Round:
    """Draft one round's trees for trials whose last committed tokens are root [T]."""
    t = root.shape[0]
    stochastic = kind != "distinct"
    parents = [ExpansionConfig(ks).parents() for ks in shape.expansions]
    toks = [draw_levels(pair.drafts[d], ks, root, kind, gen) for d, ks in enumerate(shape.expansions)]
    rows = [rows_of(p) for p in parents]
    q = [_q_rows(pair.drafts[d], rows[d][0], root, toks[d]) for d in range(len(toks))] if stochastic else []
    if not shape.merged and not (shape.share and kind == "replacement"):
        n = int(parents[0].size)
        draws = Draws(
            np.arange(n, dtype=np.int32), np.zeros(n, np.int32), rows[0][1], _dummy_rows(rows[0][0].size)
        )
        tree = TokenTree.build(np.zeros(n), parents[0], draws=draws if stochastic else None)
        slots, qrow = draw_slots(tree)
        return Round(
            toks[0],
            torch.from_numpy(slots).expand(t, *slots.shape),
            torch.from_numpy(qrow).expand(t, *qrow.shape) if stochastic else None,
            q[0] if stochastic else None,
            tree.max_depth,
            tuple(toks),
        )
    return _merged_round(pair, parents, rows, toks, q, kind, root)


def _merged_round(
    pair: Pair,
    parents: list[np.ndarray],
    rows: list[tuple[np.ndarray, np.ndarray]],
    toks: list[torch.Tensor],
    q: list[torch.Tensor],
    kind: str,
    root: torch.Tensor,
) -> Round:
    """Trees of one or more drafters merged per trial with `shared.tree.merge` (SpecInfer Def. 3.2):
    identical root-to-node paths share a node, every draw is kept.

    The merged topology depends only on which root-to-node paths coincide, so trials are grouped by
    that pattern and `merge` runs once per pattern (on a representative trial), not once per trial.
    """
    stochastic = kind != "distinct"
    offs = np.cumsum([0] + [p.size for p in parents])
    par = np.concatenate([np.where(p >= 0, p + o, -1) for p, o in zip(parents, offs, strict=False)])
    depth = np.concatenate([TokenTree.build(np.zeros(p.size), p).depth for p in parents])
    allt = torch.cat(toks, 1).numpy()
    t, m = allt.shape
    canon = np.tile(np.arange(m), (t, 1))  # the first node with the same root-to-node path
    for i in range(m):
        for j in range(i - 1, -1, -1):
            if depth[j] != depth[i]:
                continue
            same = allt[:, j] == allt[:, i]
            if par[i] >= 0:
                same &= canon[:, par[j]] == canon[:, par[i]]
            canon[:, i] = np.where(same, canon[:, j], canon[:, i])
    patterns, pid = np.unique(canon, axis=0, return_inverse=True)
    pid = pid.reshape(-1)
    trees = []
    for p in range(patterns.shape[0]):
        rep = int(np.flatnonzero(pid == p)[0])
        parts = []
        for d, pa in enumerate(parents):
            n = pa.size
            tok = allt[rep, offs[d] : offs[d + 1]]
            qrows = _sparse_rows(q[d][rep].numpy()) if stochastic else _dummy_rows(rows[d][0].size)
            draws = Draws(np.arange(n, dtype=np.int32), np.full(n, d, np.int32), rows[d][1], qrows)
            parts.append(TokenTree.build(tok, pa, base=START_LEN, draws=draws))
        merged = merge(parts)
        assert merged.draws is not None
        remap = merged.draws.node.astype(np.int64)
        if not stochastic:
            merged = TokenTree.build(merged.tokens, merged.parents, base=START_LEN)
        merged.validate(
            pair.vocab, 64, 16, stochastic=stochastic, without_replacement=kind == "without", field="merged"
        )
        trees.append((merged, remap))
    n_max = max(tr.num_nodes for tr, _ in trees)
    tabs = [draw_slots(tr) for tr, _ in trees]
    k_max = max(s.shape[1] for s, _ in tabs)
    slots = np.full((len(trees), n_max + 1, k_max), -1, dtype=np.int64)
    qrow = np.full_like(slots, -1)
    remaps = np.stack([rm for _, rm in trees])
    for p, (s, r) in enumerate(tabs):
        slots[p, : s.shape[0], : s.shape[1]] = s
        qrow[p, : r.shape[0], : r.shape[1]] = r
    tokens = np.zeros((t, n_max), dtype=np.int64)
    np.put_along_axis(tokens, remaps[pid], allt, axis=1)
    return Round(
        torch.from_numpy(tokens),
        torch.from_numpy(slots[pid]),
        torch.from_numpy(qrow[pid]) if stochastic else None,
        torch.cat(q, 1) if stochastic else None,
        max(tr.max_depth for tr, _ in trees),
        tuple(toks),
    )
