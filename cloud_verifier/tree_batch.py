"""A batch of token trees as tensors for verification (docs/architecture.md §3.4): each row's
children as slots (`draw_slots`), the q rows padded to one width (`padded_rows`), and `TreeBatch`,
T trees stacked with -1 padding (production verifies T = 1; the exactness harness stacks many
trials)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from cloud_verifier.sampling import (
    to_device,
)
from shared.sparse import Q_TOTAL, SparseRows
from shared.tree import TokenTree


def draw_slots(tree: TokenTree) -> tuple[np.ndarray, np.ndarray]:
    """The draws (stochastic trees) or children (deterministic trees) at each row, in order.

    Returns slots [N + 1, K] int64 (the node made by the k-th draw at row r; row 0 = the last
    committed token, row 1 + i = node i; -1 = none) and qrow [N + 1, K] int64 (that draw's q row,
    -1 for none or for a deterministic tree). A node shared by several draws appears once per draw.
    """
    n = tree.num_nodes
    if tree.draws is not None:
        node = tree.draws.node.astype(np.int64)
        qrow = tree.draws.qrow.astype(np.int64)
    else:
        node = np.arange(n, dtype=np.int64)
        qrow = np.full(n, -1, dtype=np.int64)
    row = tree.parents.astype(np.int64)[node] + 1
    order = np.argsort(row, kind="stable")  # draw order (node order) within each row
    counts = np.bincount(row, minlength=n + 1)
    start = np.concatenate(([0], np.cumsum(counts)[:-1]))
    rank = np.arange(row.size) - start[row[order]]
    k = max(int(counts.max(initial=0)), 1)
    slots = np.full((n + 1, k), -1, dtype=np.int64)
    rows = np.full((n + 1, k), -1, dtype=np.int64)
    slots[row[order], rank] = node[order]
    rows[row[order], rank] = qrow[order]
    return slots, rows


def padded_rows(q: SparseRows) -> tuple[np.ndarray, np.ndarray]:
    """CSR q rows as padded arrays: ids [R, Kq] int64 and probs [R, Kq] float32 (weight / 2^16, exact
    in float32). A row is padded with its last id at probability 0, so ids stay sorted and in range."""
    lengths = np.diff(q.ptr)
    width = max(int(lengths.max(initial=0)), 1)
    row = np.repeat(np.arange(lengths.size), lengths)
    col = np.arange(q.ids.size) - q.ptr[:-1][row]
    ids = np.repeat(q.ids[q.ptr[1:] - 1].astype(np.int64)[:, None], width, axis=1)
    probs = np.zeros((lengths.size, width), dtype=np.float32)
    ids[row, col] = q.ids
    probs[row, col] = q.weights / Q_TOTAL
    return ids, probs


@dataclass(frozen=True)
class TreeBatch:
    """T token trees of at most N nodes on one device; each trial may have its own topology.

    q rows are padded sparse rows (u16 weights / 2^16; ids sorted within a row, pads at probability
    0), one set per trial. Tensors may be expanded (stride 0) along T where trials share them.
    """

    tokens: torch.Tensor  # [T, N] int64, token of each node
    slots: torch.Tensor  # [T, N + 1, K] int64, node made by the k-th draw/child at each row, -1 none
    committed_len: np.ndarray  # [T] int64, L of each trial (host: keys the sampler by position)
    depth: int  # max node depth over the batch (the walk visits at most depth + 1 rows)
    qrow: torch.Tensor | None = None  # [T, N + 1, K] int64, q row of each draw, -1 none
    q_ids: torch.Tensor | None = None  # [T, R, Kq] int64, token ids of each q row, sorted
    q_probs: torch.Tensor | None = None  # [T, R, Kq] float32, q(id); pads 0

    @property
    def num_trials(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def is_stochastic(self) -> bool:
        return self.qrow is not None

    @classmethod
    def from_tree(cls, tree: TokenTree, device: torch.device | str = "cpu") -> TreeBatch:
        """One tree as a batch of one (the production path)."""
        dev = torch.device(device)
        slots, qrow = draw_slots(tree)
        tokens = to_device(tree.tokens.astype(np.int64), dev).unsqueeze(0)
        lens = np.array([tree.committed_len], dtype=np.int64)
        if tree.draws is None:
            return cls(tokens, to_device(slots, dev)[None], lens, tree.max_depth)
        ids, probs = padded_rows(tree.draws.q)
        return cls(
            tokens,
            to_device(slots, dev)[None],
            lens,
            tree.max_depth,
            to_device(qrow, dev)[None],
            to_device(ids, dev)[None],
            to_device(probs, dev)[None],
        )

    @classmethod
    def stack(cls, batches: Sequence[TreeBatch]) -> TreeBatch:
        """The trials of several batches as one, padded to the largest N, K, R and row width (their
        logits must be padded to the same N + 1 rows; padded rows are never visited)."""
        n = max(b.tokens.shape[1] for b in batches)
        k = max(b.slots.shape[2] for b in batches)
        stochastic = {b.is_stochastic for b in batches}
        if len(stochastic) != 1:
            raise ValueError("cannot stack stochastic and deterministic trees")

        def cat(xs: list[torch.Tensor], value: int | float, mode: str = "constant") -> torch.Tensor:
            width = max(x.shape[-1] for x in xs)
            rows = max(x.shape[-2] for x in xs) if xs[0].dim() == 3 else 0
            out = []
            for x in xs:
                if x.shape[-1] < width:
                    x = F.pad(
                        x, (0, width - x.shape[-1]), mode=mode, value=None if mode != "constant" else value
                    )
                if rows and x.shape[-2] < rows:
                    x = F.pad(x, (0, 0, 0, rows - x.shape[-2]), value=value)
                out.append(x)
            return torch.cat(out)

        tokens = cat([b.tokens for b in batches], 0)
        slots = cat([F.pad(b.slots, (0, k - b.slots.shape[2]), value=-1) for b in batches], -1)
        lens = np.concatenate([b.committed_len for b in batches])
        depth = max(b.depth for b in batches)
        if not stochastic.pop():
            return cls(tokens, slots, lens, depth)
        qrow = cat(
            [F.pad(b.qrow, (0, k - b.qrow.shape[2]), value=-1) for b in batches if b.qrow is not None], -1
        )
        ids = cat([b.q_ids.float() for b in batches if b.q_ids is not None], 0, "replicate").long()
        probs = cat([b.q_probs for b in batches if b.q_probs is not None], 0.0)
        assert slots.shape[1] == n + 1
        return cls(tokens, slots, lens, depth, qrow, ids, probs)
