"""Sampling and coupling: how a drafted row of logits becomes candidate tokens.

Deterministic modes (greedy, match) take the draft's top-k tokens at each node, ranked by its
logits at temperature 1 (`ranked`); with `Coupling` (match at temperature > 0) the token the
target will sample, by the verifier's keyed uniforms, leads. Stochastic modes (mss, rrs) draw
from a q row (`Sampling.q_row`): the draft distribution at the requested temperature / top-k /
top-p, truncated to at most `wire_top_k` tokens and quantized to u16 weights FIRST
(shared.sparse), so that the edge samples from exactly the weights that travel with the tree.

Saguaro sampling (`Saguaro`, pre-speculation only): the row a node draws from and ships is q with
the weights of the tokens pre-speculation caches there scaled by C < 1 (`Sampling.shipped_row`).
The verifier tests the draws against exactly that row, so the output stays the target's; what the
draft believes (the alternatives the outcome model reads, each node's probability) stays q.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from shared.keyed import BELOW_ONE, keyed_uniforms
from shared.messages import Mode
from shared.sparse import SparseDist, quantize, truncate
from shared.temperature import tempered

WIRE_TOP_K = 48  # default cap on q-row length: ~6 bytes a token on the wire, ~0.3 KB a row


@dataclass(frozen=True)
class Saguaro:
    """Saguaro sampling (SSD, arXiv 2603.03251): bend a q row toward the tokens pre-speculation
    caches, so that the bonus token after a rejection lands on one of them more often.

    After the draws at a node are rejected, mss / rrs draw the bonus from the residual
    norm(max(0, p - q)). Scaling the cached candidates' weights in q by c < 1 (the row
    renormalised) lowers q there and so raises the residual there: were the draft equal to the
    target, the residual would lie on the candidates alone. The edge draws the node's tokens from
    the scaled row and ships that row with the tree; the verifier tests the draws against exactly
    the row shipped, so the output is still exactly the target's, whatever c.

    The candidates at a node that makes k draws are the `fanout + k` heaviest tokens of its q row
    (ties: the lower token id). Pre-speculation caches, as bonus candidates at a node, the draft's
    likeliest tokens other than the drafted children (speculation.outcomes), at most `fanout` of
    them; the children are most often the k likeliest, so this set is the drafted children and the
    `fanout` bonus candidates behind them. It is chosen before drawing, from q alone: a set that
    depended on the draws would make the row they were drawn from depend on them, and the row
    shipped would no longer be the one drawn from (the reference implementation likewise scales
    the F + 1 likeliest tokens of a chain's rows).

    c:      the factor, 0 < c <= 1 (1: the row is left as it is)
    fanout: bonus candidates cached per node (PrespecConfig.fanout)
    """

    c: float
    fanout: int = 3

    def __post_init__(self) -> None:
        if not 0 < self.c <= 1:
            raise ValueError(f"Saguaro sampling needs 0 < c <= 1 (1: off), got {self.c!r}")
        if self.fanout < 1:
            raise ValueError(f"Saguaro sampling needs fanout >= 1, got {self.fanout!r}")

    def candidates(self, q: SparseDist, draws: int) -> np.ndarray:
        """Positions in `q` (ascending) of the tokens scaled at a node making `draws` draws."""
        n = min(self.fanout + max(draws, 0), len(q))
        heaviest: np.ndarray = np.argsort(-q.weights, kind="stable")[:n]  # ids ascending: ties by id
        return np.sort(heaviest)

    def apply(self, q: SparseDist, draws: int) -> SparseDist:
        """The row a node making `draws` draws samples from and ships: q with its candidates'
        weights times c, renormalised and quantized again (every weight stays >= 1, the sum 2^16)."""
        at = self.candidates(q, draws)
        if self.c == 1 or at.size == len(q):  # nothing scaled, or everything alike: q itself
            return q
        w = q.weights.astype(np.float64)
        w[at] *= self.c
        return SparseDist(q.ids.copy(), quantize(w))


@dataclass(frozen=True)
class Sampling:
    """What the target is asked to do; stochastic trees draw from the same transform of the draft.

    temperature, top_k (0: all), top_p: applied to the draft logits as the target applies them
    wire_top_k: the most tokens a q row keeps (bounds bytes per round); the top_p mass is taken
                over the top_k set first, then the row is cut to wire_top_k tokens
    saguaro:    Saguaro sampling of the rows drawn from and shipped (pre-speculation; None: off)
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    wire_top_k: int = WIRE_TOP_K
    saguaro: Saguaro | None = None

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError("stochastic drafting needs temperature > 0 (temperature 0 is mode greedy)")
        if not 0 < self.top_p <= 1 or self.top_k < 0 or self.wire_top_k < 1:
            raise ValueError("need 0 < top_p <= 1, top_k >= 0, wire_top_k >= 1")

    def q_row(self, logits: np.ndarray) -> SparseDist:
        """The quantized draft row q for logits [V]: the edge samples from exactly these weights."""
        p = softmax(tempered(logits.astype(np.float64), self.temperature))
        idx = truncate(p, self.top_k, self.top_p)[: self.wire_top_k]
        w = quantize(p[idx])
        order = np.argsort(idx, kind="stable")
        return SparseDist(idx[order].astype(np.int32), w[order])

    def shipped_row(self, q: SparseDist, draws: int) -> SparseDist:
        """The row a node making `draws` draws samples them from and ships with the tree: its q row
        `q` (from `q_row`), with Saguaro sampling its candidates scaled (`Saguaro.apply`)."""
        return q if self.saguaro is None else self.saguaro.apply(q, draws)


@dataclass(frozen=True)
class Coupling:
    """Sample-and-match drafting with the target's own randomness (mode match at temperature > 0).

    The verifier samples the token at absolute position `pos` by inverse CDF of its p at
    `keyed_uniform(seed, pos)` (shared.keyed), and the edge chose the seed. Drafting with the same
    uniform on the draft's distribution (the same temperature / top-k / top-p, the CDF in token-id
    order) proposes the token the target will sample wherever the two distributions are close: at
    every node the coupled token becomes the first child, ahead of the draft's most likely ones.
    Nothing about exactness changes (the verifier samples from p whatever the tree); only what the
    edge guesses does. The edge's outcome model then treats the coupled token as the draft's
    "top" token (edge_client.speculation.outcomes.ChoiceModel), as greedy verification does the argmax.
    """

    seed: int
    temperature: float
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError("coupling needs temperature > 0 (temperature 0 is greedy)")
        if not 0 < self.top_p <= 1 or self.top_k < 0:
            raise ValueError("need 0 < top_p <= 1 and top_k >= 0")

    def token(self, logits: np.ndarray, position: int) -> int:
        """The draft's token at absolute `position` by inverse CDF at the keyed uniform there."""
        p = softmax(tempered(logits.astype(np.float64), self.temperature))
        if self.top_k > 0 or self.top_p < 1:
            keep = np.sort(truncate(p, self.top_k, self.top_p))  # token-id order, as the target's CDF
            cdf = np.cumsum(p[keep])
        else:
            keep, cdf = None, np.cumsum(p)
        u = float(keyed_uniforms(self.seed, position))
        i = int(np.searchsorted(cdf, min(u * cdf[-1], cdf[-1] * BELOW_ONE), side="right"))
        i = min(i, cdf.size - 1)
        return int(keep[i]) if keep is not None else i


def ranked(
    logits: np.ndarray, k: int, coupling: Coupling | None, position: int
) -> tuple[np.ndarray, np.ndarray]:
    """The k candidate tokens after logits [V], best first, with their log-probabilities at
    temperature 1: the draft's most likely ones, or with `coupling` the coupled token first."""
    ids, vals = top_logp(logits, k)
    if coupling is None:
        return ids, vals
    c = coupling.token(logits, position)
    hit = np.flatnonzero(ids == c)
    if hit.size:
        j = int(hit[0])
        order = np.r_[j, np.delete(np.arange(ids.size), j)]
        return ids[order], vals[order]
    lp_c = float(logits[c]) - float(logits[ids[0]]) + float(vals[0])  # log-softmax via the top one
    return np.r_[c, ids[:-1]].astype(ids.dtype), np.r_[lp_c, vals[:-1]]


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    p: np.ndarray = e / e.sum(axis=-1, keepdims=True)
    return p


def top_logp(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k most likely tokens after logits [V] at temperature 1, most likely first:
    (ids [k] int64, log-probabilities [k] float64). Ranks the raw logits (argpartition, O(V)) and
    normalizes only the chosen ones: no full-vocabulary softmax or sort."""
    k = min(k, logits.size)
    idx = np.argpartition(logits, logits.size - k)[logits.size - k :]  # no negated copy of the row
    idx = idx[np.argsort(-logits[idx], kind="stable")]
    m = float(logits[idx[0]])
    lse = m + math.log(float(np.exp(logits - np.float32(m)).sum(dtype=np.float64)))
    return idx, logits[idx].astype(np.float64) - lse


def draft_mode(mode: Mode | str) -> Mode:
    m = Mode(mode)
    if m is Mode.AR:
        raise ValueError("mode ar is target-only decoding: it drafts no tree")
    return m


def top_alternatives(
    logits: np.ndarray,
    a: int,
    sampling: Sampling | None,
    coupling: Coupling | None = None,
    position: int = 0,
) -> tuple[np.ndarray, np.ndarray]:
    """The draft's `a` most likely next tokens and their probabilities: from the q row of
    stochastic modes (`sampling`; the draft's own, before any Saguaro scaling), else softmax at
    temperature 1 (with `coupling`, the coupled token at absolute `position` first)."""
    if sampling is not None:
        q = sampling.q_row(logits)
        order = np.argsort(-q.weights, kind="stable")[:a]
        return q.ids[order], q.weights[order] / 65536.0
    ids, vals = ranked(logits, a, coupling, position)
    return ids, np.exp(vals)


def coupling_for(mode: Mode, coupling: Coupling | None) -> Coupling | None:
    """Coupling applies to sample-and-match only (greedy has no randomness; mss/rrs sample q)."""
    return coupling if mode is Mode.MATCH else None
