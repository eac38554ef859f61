"""Sparse draft distributions quantized to u16 weights (PROTOCOL.md section 6).

A draft row q is a set of token ids with integer weights that sum to exactly 2^16 = 65,536. The
edge quantizes FIRST and then samples from exactly these weights; the verifier divides by 2^16.
Both sides (and any mobile client) then agree bit for bit on q, which is what makes MSS / RRS
verification exact whatever truncation the edge applied.

On the wire a weight w is in [1, 65536], one more than a u16 holds, so it travels as `w - 1`
(u16). Every kept token has w >= 1: a kept token never has zero mass.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from shared.errors import ErrorCode, ProtocolError

Q_TOTAL = 1 << 16  # the weights of one row sum to exactly this
MAX_ROW_TOKENS = Q_TOTAL  # each kept token has weight >= 1


def _bad(message: str, field: str) -> ProtocolError:
    return ProtocolError(ErrorCode.BAD_DISTRIBUTION, message, field)


def truncate(probs: np.ndarray, top_k: int = 0, top_p: float = 1.0) -> np.ndarray:
    """Indices of the tokens kept by top-k then top-p, most likely first.

    probs: [V] finite, non-negative, positive sum (it need not sum to 1).
    top_k=0 keeps every token with positive probability; top_p=1 keeps the whole top-k set.
    """
    if probs.ndim != 1:
        raise ValueError(f"probs must be 1-D, got shape {probs.shape}")
    p = probs.astype(np.float64, copy=False)
    if not np.all(np.isfinite(p)) or np.any(p < 0) or not p.sum() > 0:
        raise _bad("probabilities must be finite, non-negative and not all zero", "probs")
    nonzero = int(np.count_nonzero(p))
    k = nonzero if top_k <= 0 else min(top_k, nonzero)
    k = min(k, MAX_ROW_TOKENS)
    # top-k before any sort: argpartition is O(V), then only k entries are sorted.
    if k < p.size:
        idx = np.argpartition(-p, k - 1)[:k]
    else:
        idx = np.arange(p.size)
    idx = idx[np.argsort(-p[idx], kind="stable")]
    idx = idx[p[idx] > 0]
    if top_p < 1.0:
        kept = p[idx]
        cum = np.cumsum(kept) / kept.sum()
        # keep the smallest prefix whose mass reaches top_p (at least one token)
        n = int(np.searchsorted(cum, top_p, side="left")) + 1
        idx = idx[: min(n, idx.size)]
    return idx


def quantize(p: np.ndarray) -> np.ndarray:
    """Integer weights >= 1 summing to exactly Q_TOTAL, proportional to p (largest remainder).

    p: [k] positive. Returns int64 [k].
    """
    k = p.size
    if k == 0 or k > MAX_ROW_TOKENS:
        raise _bad(f"a row keeps 1..{MAX_ROW_TOKENS} tokens, got {k}", "probs")
    scaled = p / p.sum() * Q_TOTAL
    w: np.ndarray = np.maximum(np.floor(scaled).astype(np.int64), 1)
    diff = Q_TOTAL - int(w.sum())
    if diff > 0:
        # hand out the missing units to the largest fractional remainders
        order = np.argsort(-(scaled - np.floor(scaled)), kind="stable")
        w[order[:diff]] += 1
    while diff < 0:
        # the floor-at-1 rule overshot: take units back from the heaviest tokens (never below 1)
        order = np.argsort(-w, kind="stable")
        room = order[w[order] > 1][:-diff]
        w[room] -= 1
        diff = Q_TOTAL - int(w.sum())
    return w


@dataclass(frozen=True, eq=False)
class SparseDist:
    """One quantized draft row.

    ids:     [k] int32, strictly increasing token ids
    weights: [k] int64 in [1, 65536], sum exactly 65536
    """

    ids: np.ndarray
    weights: np.ndarray

    @classmethod
    def from_probs(cls, probs: np.ndarray, top_k: int = 0, top_p: float = 1.0) -> SparseDist:
        """Truncate (top-k, then top-p), renormalize and quantize a probability vector [V]."""
        idx = truncate(probs, top_k, top_p)
        w = quantize(probs.astype(np.float64)[idx])
        order = np.argsort(idx, kind="stable")
        return cls(idx[order].astype(np.int32), w[order])

    @classmethod
    def from_weights(cls, ids: Sequence[int] | np.ndarray, weights: Sequence[int] | np.ndarray) -> SparseDist:
        d = cls(np.asarray(ids, dtype=np.int32), np.asarray(weights, dtype=np.int64))
        d.check()
        return d

    def check(self, vocab_size: int | None = None, field: str = "q") -> None:
        """Raise ProtocolError unless this is a valid row over [0, vocab_size)."""
        check_row(self.ids, self.weights, vocab_size, field)

    def __len__(self) -> int:
        return int(self.ids.size)

    def prob(self, token: int) -> float:
        """q(token), exactly weight / 2^16 (0 for a token not in the row)."""
        i = int(np.searchsorted(self.ids, token))
        if i < self.ids.size and int(self.ids[i]) == token:
            return float(self.weights[i]) / Q_TOTAL
        return 0.0

    def weight(self, token: int) -> int:
        i = int(np.searchsorted(self.ids, token))
        if i < self.ids.size and int(self.ids[i]) == token:
            return int(self.weights[i])
        return 0

    def dense(self, vocab_size: int) -> np.ndarray:
        """[vocab_size] float64 probabilities."""
        out = np.zeros(vocab_size, dtype=np.float64)
        out[self.ids] = self.weights / Q_TOTAL
        return out

    def sample(self, rng: np.random.Generator, n: int = 1) -> np.ndarray:
        """n draws WITH replacement, exactly proportional to the integer weights. [n] int32."""
        cum = np.cumsum(self.weights)
        r = rng.integers(0, Q_TOTAL, size=n)
        return self.ids[np.searchsorted(cum, r, side="right")]

    def sample_without_replacement(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """n distinct draws in draw order (Gumbel-top-k on log weights), [n] int32.

        Sorting keys log(w) + Gumbel in descending order gives successive sampling without
        replacement: the first is a draw from q, the next a draw from q without the first, etc.
        """
        if n > self.ids.size:
            raise ValueError(f"cannot draw {n} distinct tokens from a row of {self.ids.size}")
        keys = np.log(self.weights.astype(np.float64)) + rng.gumbel(size=self.ids.size)
        top = np.argpartition(-keys, n - 1)[:n] if n < self.ids.size else np.arange(self.ids.size)
        top = top[np.argsort(-keys[top], kind="stable")]
        return self.ids[top]


def check_row(ids: np.ndarray, weights: np.ndarray, vocab_size: int | None, field: str) -> None:
    if ids.ndim != 1 or weights.ndim != 1 or ids.size != weights.size:
        raise _bad("ids and weights must be 1-D arrays of one length", field)
    if ids.size == 0:
        raise _bad("a row needs at least one token", field)
    if np.any(weights < 1) or np.any(weights > Q_TOTAL):
        raise _bad("every weight must be in [1, 65536] (no zero-mass or negative weights)", field)
    if int(weights.sum()) != Q_TOTAL:
        raise _bad(f"weights must sum to exactly {Q_TOTAL}, got {int(weights.sum())}", field)
    if ids.size > 1 and np.any(np.diff(ids.astype(np.int64)) <= 0):
        raise _bad("token ids of a row must be strictly increasing", field)
    if vocab_size is not None and (int(ids[0]) < 0 or int(ids[-1]) >= vocab_size):
        raise ProtocolError(ErrorCode.OUT_OF_RANGE, f"token ids must be in [0, {vocab_size})", field)


@dataclass(frozen=True, eq=False)
class SparseRows:
    """Several rows in CSR form, as they travel on the wire.

    ptr:     [R + 1] int64, ptr[0] = 0, non-decreasing, ptr[R] = nnz
    ids:     [nnz] int32, strictly increasing within a row
    weights: [nnz] int64 in [1, 65536], each row summing to 65536
    """

    ptr: np.ndarray
    ids: np.ndarray
    weights: np.ndarray

    @classmethod
    def from_rows(cls, rows: Sequence[SparseDist]) -> SparseRows:
        ptr = np.zeros(len(rows) + 1, dtype=np.int64)
        ptr[1:] = np.cumsum([len(r) for r in rows]) if rows else []
        ids = np.concatenate([r.ids for r in rows]).astype(np.int32) if rows else np.zeros(0, np.int32)
        w = np.concatenate([r.weights for r in rows]).astype(np.int64) if rows else np.zeros(0, np.int64)
        return cls(ptr, ids, w)

    @property
    def num_rows(self) -> int:
        return int(self.ptr.size) - 1

    def row(self, r: int) -> SparseDist:
        a, b = int(self.ptr[r]), int(self.ptr[r + 1])
        return SparseDist(self.ids[a:b], self.weights[a:b])

    def check(self, vocab_size: int | None = None, field: str = "q") -> None:
        """Raise ProtocolError unless every row is valid."""
        ptr = self.ptr
        if ptr.ndim != 1 or ptr.size < 1 or int(ptr[0]) != 0:
            raise _bad("row pointers must start at 0", f"{field}_ptr")
        if np.any(np.diff(ptr) < 1):
            raise _bad("row pointers must strictly increase (no empty rows)", f"{field}_ptr")
        if int(ptr[-1]) != self.ids.size or self.ids.size != self.weights.size:
            raise _bad("the last row pointer must equal the number of ids and weights", f"{field}_ptr")
        w = self.weights
        if np.any(w < 1) or np.any(w > Q_TOTAL):
            raise _bad("every weight must be in [1, 65536]", f"{field}_weights")
        sums = np.add.reduceat(w, ptr[:-1]) if ptr.size > 1 else np.zeros(0, np.int64)
        if np.any(sums != Q_TOTAL):
            raise _bad(f"each row's weights must sum to exactly {Q_TOTAL}", f"{field}_weights")
        if self.ids.size:
            inc = np.diff(self.ids.astype(np.int64)) > 0
            starts = np.zeros(self.ids.size, dtype=bool)
            starts[ptr[:-1]] = True
            if not np.all(inc | starts[1:]):
                raise _bad("token ids of a row must be strictly increasing", f"{field}_ids")
            if vocab_size is not None and (int(self.ids.min()) < 0 or int(self.ids.max()) >= vocab_size):
                raise ProtocolError(
                    ErrorCode.OUT_OF_RANGE, f"token ids must be in [0, {vocab_size})", f"{field}_ids"
                )

    def weight_of(self, rows: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        """Weight of tokens[i] in row rows[i] (0 when absent). [n] int64."""
        out = np.zeros(tokens.size, dtype=np.int64)
        for i, (r, t) in enumerate(zip(rows.tolist(), tokens.tolist(), strict=True)):
            out[i] = self.row(r).weight(t)
        return out
