"""Sampling and coupling: how a drafted row of logits becomes candidate tokens.

Deterministic modes (greedy, match) take the draft's top-k tokens at each node, ranked by its
logits at temperature 1 (`ranked`); with `Coupling` (match at temperature > 0) the token the
target will sample, by the verifier's keyed uniforms, leads, and the others follow by where the
target's token lands when it is not that one (the landing model: `Landing`, `landing_shares`,
`Coupling.rank`). Stochastic modes (mss, rrs) draw
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
from dataclasses import dataclass, field

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


# The landing model's scale grid: sigma is learned as a posterior over these values (Landing)
LANDING_SIGMAS = np.geomspace(1e-4, 1.0, 29)
LANDING_HEAVY = 64  # candidates: the row's heaviest tokens (those within reach of u can take a miss)
LANDING_NEAREST = 32  # and the coupled token's nearest neighbours in the CDF on each side
LANDING_RECORDED = 32  # candidates recorded per row (besides the coupled token) to learn sigma from


@dataclass(frozen=True, eq=False)
class LandingRow:
    """One coupled row's candidates in the draft's tempered CDF, what learning sigma needs.

    tokens: [W] the coupled token first, then the candidates by landing probability
    lo, hi: [W] each candidate's interval [F(x-), F(x)) in q_T's normalized CDF (token-id order),
            minus u: the coupled token's straddles 0 (lo[0] <= 0 < hi[0]); the others lie left
            (hi <= lo[0]) or right (lo >= hi[0]) of it
    u:      the keyed uniform, as the inverse-CDF threshold over the row's total (in [0, 1))
    """

    tokens: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    u: float

    def shares(self, sigma: float | np.ndarray) -> np.ndarray:
        """P(target = tokens[1:] | target != tokens[0]) under the landing model with scale
        `sigma` (a scalar: [W - 1]; an array [G]: [G, W - 1])."""
        return landing_shares(self.lo[1:], self.hi[1:], -float(self.lo[0]), float(self.hi[0]), self.u, sigma)


def landing_shares(
    lo: np.ndarray, hi: np.ndarray, left: float, right: float, u: float, sigma: float | np.ndarray
) -> np.ndarray:
    """The landing model: P(target = x | target != the coupled token c) for candidates x.

    The target samples where p's CDF crosses u; with p close to the draft's tempered q, p's CDF is
    q's shifted near u by an error e, so the target's token is the one whose q-interval holds
    u - e. Model e as Laplace(0, sigma) (heavy-tailed: the CDF error is a sum of the mass the two
    models disagree on, carried by a few tokens). The target misses c when u - e leaves c's
    interval, `left` below u or `right` above it; a candidate with interval [lo, hi) (offsets
    from u, all on one side of c's) then gets the Laplace mass of its interval over the mass of
    the row outside c's interval ([-u, 1 - u), the row's ends: nothing lies beyond them).

    lo, hi: [W] offsets from u; sigma: a scalar or [G] scales. Returns [W] or [G, W]. Computed
    with every exponent <= 0 (shifted by the nearer edge of c's interval), so any sigma is finite.
    """
    s = np.asarray(sigma, dtype=np.float64)
    grid = s.ndim > 0
    s = s.reshape(-1, 1)
    lo64, hi64 = np.asarray(lo, dtype=np.float64), np.asarray(hi, dtype=np.float64)
    m = min(left, right)
    rside = lo64 >= right  # right of c (lo >= c's upper edge), else left of it (hi <= its lower edge)
    a = np.where(rside, lo64 - m, -hi64 - m)  # the near edge's distance beyond m (>= 0)
    b = np.where(rside, hi64 - m, -lo64 - m)  # the far edge's
    num = np.exp(-np.maximum(a, 0.0) / s) - np.exp(-np.maximum(b, 0.0) / s)
    den = (
        np.exp(-(right - m) / s)
        - np.exp(-max(1.0 - u - m, 0.0) / s)
        + np.exp(-(left - m) / s)
        - np.exp(-max(u - m, 0.0) / s)
    )
    out: np.ndarray = np.where(den > 0, np.maximum(num, 0.0) / np.where(den > 0, den, 1.0), 0.0)
    return out if grid else out[0]


@dataclass
class Landing:
    """Where the target's token lands after it missed the coupled one: the scale sigma of the
    landing model (`landing_shares`), learned online.

    sigma is a posterior over LANDING_SIGMAS: a log-normal prior (median `prior_sigma`, log-sd
    `prior_spread`) plus the decayed log-likelihoods of the observed mismatches, each the
    probability the model gave the target's actual token given that it was not the coupled one
    (or, for a token outside the recorded candidates, the model's mass outside them); sigma is
    the posterior mean of log sigma. The outcome model (edge_client.speculation.outcomes
    .ChoiceModel) feeds it from verdicts; the coupling ranks with the sigma it has learned.
    """

    prior_sigma: float = 0.03
    prior_spread: float = 1.5
    decay: float = 0.99
    loglik: np.ndarray = field(default_factory=lambda: np.zeros(LANDING_SIGMAS.size))
    seen: float = 0.0

    @property
    def posterior(self) -> np.ndarray:
        """[G] posterior weights over LANDING_SIGMAS."""
        prior = -0.5 * (np.log(LANDING_SIGMAS / self.prior_sigma) / self.prior_spread) ** 2
        z = prior + self.loglik
        w: np.ndarray = np.exp(z - z.max())
        out: np.ndarray = w / w.sum()
        return out

    @property
    def sigma(self) -> float:
        return float(np.exp(np.dot(self.posterior, np.log(LANDING_SIGMAS))))

    def observe(self, row: LandingRow, target: int) -> None:
        """A verdict's token `target` at a row where the target missed the coupled token."""
        if row.tokens.size < 1 or target == int(row.tokens[0]):
            return
        shares = row.shares(LANDING_SIGMAS)  # [G, W - 1]
        at = np.flatnonzero(row.tokens[1:] == target)
        like = shares[:, int(at[0])] if at.size else 1.0 - shares.sum(axis=1)
        self.loglik = self.decay * self.loglik + np.log(np.clip(like, 1e-12, None))
        self.seen = self.decay * self.seen + 1.0

    def adopt(self, other: Landing) -> None:
        """Take `other`'s learned state (the drafting side follows the outcome model's learner)."""
        self.prior_sigma, self.prior_spread, self.decay = other.prior_sigma, other.prior_spread, other.decay
        self.loglik, self.seen = other.loglik.copy(), other.seen


@dataclass(frozen=True)
class Ranking:
    """A coupled row's candidates, best first (`Coupling.rank`).

    ids:   [k] the coupled token, then the others by the landing model's P(target = x | miss)
    logp:  [k] their draft log-probabilities at temperature 1 (the tree's node probabilities)
    probs: [k] what the outcome model reads: the coupled token's tempered draft probability
           q_T(c), then (1 - q_T(c)) * P(target = x | miss): the draft's mass outside c, spread
           by the landing model (so a share over 1 - probs[0] is P(x | miss) itself)
    row:   the candidates' intervals, to learn sigma from the verdict
    """

    ids: np.ndarray
    logp: np.ndarray
    probs: np.ndarray
    row: LandingRow


@dataclass(frozen=True)
class Coupling:
    """Sample-and-match drafting with the target's own randomness (mode match at temperature > 0).

    The verifier samples the token at absolute position `pos` by inverse CDF of its p at
    `keyed_uniform(seed, pos)` (shared.keyed), and the edge chose the seed. Drafting with the same
    uniform on the draft's distribution (the same temperature / top-k / top-p, the CDF in token-id
    order) proposes the token the target will sample wherever the two distributions are close: at
    every node the coupled token becomes the first child. Nothing about exactness changes (the
    verifier samples from p whatever the tree); only what the edge guesses does.

    After the coupled token, candidates are ranked by where the target's token lands when it is
    not the coupled one (`Landing`, `landing_shares`): near u in the CDF's token-id order, not
    simply among the draft's most probable tokens. `landing` holds the learned scale; the edge's
    outcome model (edge_client.speculation.estimates.ChoiceModel) treats the coupled token as
    greedy verification does the argmax and the others by the landing probabilities.
    """

    seed: int
    temperature: float
    top_k: int = 0
    top_p: float = 1.0
    landing: Landing = field(default_factory=Landing, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError("coupling needs temperature > 0 (temperature 0 is greedy)")
        if not 0 < self.top_p <= 1 or self.top_k < 0:
            raise ValueError("need 0 < top_p <= 1 and top_k >= 0")

    def _cdf(self, logits: np.ndarray) -> tuple[np.ndarray | None, np.ndarray, np.ndarray]:
        """(kept ids in id order or None: all, their tempered probabilities, their CDF)."""
        p = softmax(tempered(logits.astype(np.float64), self.temperature))
        if self.top_k > 0 or self.top_p < 1:
            keep = np.sort(truncate(p, self.top_k, self.top_p))  # token-id order, as the target's CDF
            return keep, p[keep], np.cumsum(p[keep])
        return None, p, np.cumsum(p)

    @staticmethod
    def _index(cdf: np.ndarray, u: float) -> int:
        i = int(np.searchsorted(cdf, min(u * cdf[-1], cdf[-1] * BELOW_ONE), side="right"))
        return min(i, cdf.size - 1)

    def token(self, logits: np.ndarray, position: int) -> int:
        """The draft's token at absolute `position` by inverse CDF at the keyed uniform there."""
        keep, _, cdf = self._cdf(logits)
        i = self._index(cdf, float(keyed_uniforms(self.seed, position)))
        return int(keep[i]) if keep is not None else i

    def rank(self, logits: np.ndarray, k: int, position: int) -> Ranking:
        """The coupled token at absolute `position`, then the k - 1 likeliest other targets by the
        landing model at the current sigma. Candidates: the row's LANDING_HEAVY heaviest tokens
        (one partition of the row, as for its top k: no sort of the vocabulary) and the coupled
        token's LANDING_NEAREST nearest neighbours on each side in the CDF (in a flat row they
        are the likeliest landings; in a peaked one the heavy tokens near u are)."""
        keep, probs, cdf = self._cdf(logits)
        total = float(cdf[-1])
        u_raw = float(keyed_uniforms(self.seed, position))
        c = self._index(cdf, u_raw)
        u = min(u_raw, BELOW_ONE)
        sigma = self.landing.sigma
        lo_c = float(cdf[c - 1]) / total if c > 0 else 0.0
        hi_c = float(cdf[c]) / total
        top_ids, top_vals = top_logp(logits, max(k, LANDING_HEAVY))
        top_j = top_ids if keep is None else np.searchsorted(keep, top_ids)
        if keep is not None:
            top_j = top_j[(top_j < keep.size) & (keep[np.minimum(top_j, keep.size - 1)] == top_ids)]
        near = np.arange(max(c - LANDING_NEAREST, 0), min(c + LANDING_NEAREST + 1, cdf.size))
        cand = np.unique(np.concatenate([near, top_j.astype(np.int64)]))
        cand = cand[(cand != c) & (probs[cand] > 0)]
        lo = np.where(cand > 0, cdf[np.maximum(cand - 1, 0)], 0.0) / total - u
        hi = cdf[cand] / total - u
        share = landing_shares(lo, hi, u - lo_c, hi_c - u, u, sigma)
        order = np.lexsort((-probs[cand], -share))  # by share, then by the draft's mass
        rec = order[:LANDING_RECORDED]
        ids_j = np.r_[c, cand[rec]].astype(np.int64)
        ids = ids_j if keep is None else keep[ids_j]
        row = LandingRow(
            tokens=ids.astype(np.int64),
            lo=np.r_[lo_c - u, lo[rec]],
            hi=np.r_[hi_c - u, hi[rec]],
            u=u,
        )
        q_c = float(probs[c]) / total
        alt = np.r_[q_c, (1.0 - q_c) * share[rec]]
        lse = float(logits[top_ids[0]]) - float(top_vals[0])  # top_logp's log-normalizer
        n = min(k, ids.size)
        logp = logits[ids[:n]].astype(np.float64) - lse
        return Ranking(ids[:n].astype(np.int64), logp, alt[:n], row)


def ranked(
    logits: np.ndarray, k: int, coupling: Coupling | None, position: int
) -> tuple[np.ndarray, np.ndarray]:
    """The k candidate tokens after logits [V], best first, with their log-probabilities at
    temperature 1: the draft's most likely ones, or with `coupling` the coupled token first and
    then the likeliest other targets by the landing model (`Coupling.rank`)."""
    if coupling is None:
        return top_logp(logits, k)
    r = coupling.rank(logits, k, position)
    return r.ids, r.logp


def ranked_alts(
    logits: np.ndarray, k: int, coupling: Coupling | None, position: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, LandingRow | None]:
    """`ranked` with what the builder records after the row: (ids, log-probabilities at
    temperature 1, the alternatives' probabilities for the outcome model, the landing row).
    Uncoupled: the probabilities are the draft's at temperature 1 and there is no landing row."""
    if coupling is None:
        ids, vals = top_logp(logits, k)
        return ids, vals, np.exp(vals), None
    r = coupling.rank(logits, k, position)
    return r.ids, r.logp, r.probs, r.row


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
    temperature 1 (with `coupling`, the coupled token at absolute `position` first and the
    landing model's candidates and probabilities after it, `Ranking.probs`)."""
    if sampling is not None:
        q = sampling.q_row(logits)
        order = np.argsort(-q.weights, kind="stable")[:a]
        return q.ids[order], q.weights[order] / 65536.0
    ids, _, probs, _ = ranked_alts(logits, a, coupling, position)
    return ids, probs


def coupling_for(mode: Mode, coupling: Coupling | None) -> Coupling | None:
    """Coupling applies to sample-and-match only (greedy has no randomness; mss/rrs sample q)."""
    return coupling if mode is Mode.MATCH else None
