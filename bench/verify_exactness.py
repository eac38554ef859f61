"""Statistical proof that every verification algorithm is exact, and what it costs.

`python -m bench.verify_exactness [--samples N] [--json PATH]` runs the full matrix: algorithms x
tree shapes x temperatures, plus three deliberately wrong variants that the same test must reject.
Each case simulates what the edge and the cloud do, batched over trials on the production functions
(`cloud_verifier.verify.verify_batch`): a tiny bigram "model" pair (target logits and draft q rows,
each a random table indexed by the last token, so every row at every depth is known) drafts a fresh
tree from q every round, the verifier walks it, and rounds repeat until each trial has emitted the
next `measure` tokens. Their joint frequency is compared with the exact joint distribution under
the target alone by Pearson chi-square (cells with expected count < 5 pooled, reject at p < 1e-6).

It also reports tokens per round for each algorithm (over the same pairs, shapes and temperatures)
and the median time of one `verify_tree` call on a fixed 64-node tree over a 49,152-token vocabulary.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import zlib
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
from tqdm import tqdm

from bench.stats import chi2_pvalue
from cloud_verifier.sampling import SamplingParams, target_probs
from cloud_verifier.verify import EXACT, BatchResult, Rules, TreeBatch, draw_slots, verify_batch, verify_tree
from shared.sparse import Q_TOTAL, SparseDist, SparseRows, truncate
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


def _rows_of(parents: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
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
    rows = [_rows_of(p) for p in parents]
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


# --------------------------------------------------------------------------- simulation
@dataclass
class Outcome:
    counts: np.ndarray  # [V ** measure] joint counts of the next `measure` output tokens
    rounds: int = 0
    first_round_tokens: float = 0.0  # total tokens emitted by every trial's first round


def simulate(
    mode: str,
    pair: Pair,
    shape: Shape,
    params: SamplingParams,
    trials: int,
    seed: int,
    rules: Rules = EXACT,
    device: str = "cpu",
) -> Outcome:
    """Run `trials` independent generations from START_TOKEN until each emitted `shape.measure`
    tokens; count their joint values. Batched: every round verifies all unfinished trials at once.
    device: where verification runs (its logits, trees and generator; sync-free off the CPU);
    drafting stays on the host."""
    v, m = pair.vocab, shape.measure
    out = Outcome(np.zeros(v**m, dtype=np.int64))
    for c0 in range(0, trials, CHUNK):
        t = min(CHUNK, trials - c0)
        gen = torch.Generator().manual_seed(seed * 7919 + c0)
        vgen = gen if device == "cpu" else torch.Generator(device=device).manual_seed(seed * 7919 + c0)
        seeds = seed * 1_000_003 + c0 + np.arange(t)  # match: one session seed per trial
        emitted = torch.full((t, m), -1, dtype=torch.long)
        count = torch.zeros(t, dtype=torch.long)
        last = torch.full((t,), START_TOKEN, dtype=torch.long)
        length = np.full(t, START_LEN, dtype=np.int64)
        first = True
        while True:
            idx = torch.nonzero(count < m).squeeze(1)
            if idx.numel() == 0:
                break
            rnd = draw_round(pair, shape, TREE_KIND[mode], last[idx], gen)
            rows = torch.cat([last[idx].unsqueeze(1), rnd.tokens], 1)
            logits = pair.target[rows]  # [T', N + 1, V]: the bigram target at every row
            batch = rnd.batch(length[idx.numpy()])
            if device != "cpu":
                batch = _on(batch, device)
            res = verify_batch(
                mode,
                batch,
                logits.to(device),
                params,
                seeds=seeds[idx.numpy()],
                generator=vgen,
                rules=rules,
            )
            if device != "cpu":
                res = BatchResult(*(x.cpu() for x in (res.accepted, res.num_accepted, res.bonus, res.tokens)))
            num = res.num_accepted + 1
            for j in range(res.tokens.shape[1]):
                pos = count[idx] + j
                keep = (j < num) & (pos < m)
                emitted[idx[keep], pos[keep]] = res.tokens[keep, j]
            count[idx] += num
            last[idx] = res.bonus
            length[idx.numpy()] += num.numpy()
            out.rounds += int(idx.numel())
            if first:
                out.first_round_tokens += float(num.sum())
                first = False
        code = torch.zeros(t, dtype=torch.long)
        for j in range(m):
            code = code * v + emitted[:, j]
        out.counts += np.bincount(code.numpy(), minlength=v**m)
    return out


def _on(batch: TreeBatch, device: str) -> TreeBatch:
    """A TreeBatch's tensors on `device` (committed lengths stay on the host)."""

    def move(x: torch.Tensor | None) -> torch.Tensor | None:
        return None if x is None else x.to(device)

    return TreeBatch(
        batch.tokens.to(device),
        batch.slots.to(device),
        batch.committed_len,
        batch.depth,
        move(batch.qrow),
        move(batch.q_ids),
        move(batch.q_probs),
    )


def reference_probs(pair: Pair, params: SamplingParams) -> np.ndarray:
    """[V, V] float64 target sampling distribution given the last token, computed independently
    (float64 softmax; top-k / top-p by `shared.sparse.truncate`)."""
    logits = pair.target.double().numpy()
    v = pair.vocab
    if params.greedy:
        return np.eye(v)[logits.argmax(-1)]
    z = logits / params.temperature
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    if params.top_k or params.top_p < 1.0:
        for row in range(v):
            keep = truncate(p[row], params.top_k, params.top_p)
            mask = np.zeros(v, dtype=bool)
            mask[keep] = True
            p[row] = np.where(mask, p[row], 0.0) / p[row][mask].sum()
    return p


def joint_probs(p: np.ndarray, start: int, measure: int) -> np.ndarray:
    """[V ** measure] exact joint distribution of the next `measure` tokens after `start`."""
    v = p.shape[0]
    out = p[start]
    for _ in range(measure - 1):
        out = (out[:, None] * p[np.arange(out.size) % v]).reshape(-1)  # cell c ends in token c % V
    return out


# --------------------------------------------------------------------------- wrong variants
def unnormalised_residual(r: torch.Tensor, q_ids: torch.Tensor, q_probs: torch.Tensor) -> torch.Tensor:
    """WRONG (a): max(0, r - q) without renormalising, so the next sibling is tested against it."""
    return r.scatter_add(-1, q_ids, -torch.minimum(r.gather(-1, q_ids), q_probs))


def inverted_ratio(r_x: torch.Tensor, q_x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """WRONG (b): accept with probability min(1, q(x) / p(x))."""
    return u * r_x < q_x


def shifted_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """WRONG (c): p with 1% of the probability mass moved from the most to the second most likely token."""
    p = target_probs(logits, params)
    top = torch.topk(p, 2, dim=-1).indices
    shift = torch.tensor([-0.01, 0.01], dtype=p.dtype).expand(top.shape)
    return p.scatter_add(-1, top, shift).clamp_min(0.0)


WRONG = {
    "mss/unnormalised-residual": Rules(residual=unnormalised_residual),
    "mss/ratio-q-over-p": Rules(accepts=inverted_ratio),
    "mss/moves-1%-mass": Rules(probs=shifted_probs),
}


# --------------------------------------------------------------------------- cases
@dataclass(frozen=True)
class Case:
    algorithm: str  # a mode, or a key of WRONG
    shape: str
    temperature: float
    top_k: int = 0
    top_p: float = 1.0

    @property
    def expected_exact(self) -> bool:
        return self.algorithm not in WRONG

    @property
    def mode(self) -> str:
        return self.algorithm.split("/")[0]

    @property
    def params(self) -> SamplingParams:
        return SamplingParams(self.temperature, self.top_k, self.top_p)

    def label(self) -> str:
        extra = f" top_k={self.top_k} top_p={self.top_p}" if self.top_k or self.top_p < 1 else ""
        return f"{self.algorithm} {self.shape} T={self.temperature}{extra}"


@dataclass
class CaseResult:
    algorithm: str
    shape: str
    temperature: float
    samples: int
    p_value: float
    expected_exact: bool
    passed: bool
    top_k: int = 0
    top_p: float = 1.0
    tokens_per_round: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)


def full_matrix() -> list[Case]:
    cases = [Case(a, s, t) for a in ("match", "naive", "mss", "rrs") for s in SHAPES for t in (0.5, 1.0)]
    cases += [Case(a, "wide", 1.0, top_k=10, top_p=0.9) for a in ("match", "mss", "rrs")]
    cases += [Case(a, "merged", 1.0, top_p=0.8) for a in ("match", "mss", "rrs")]
    cases += [Case("mss", UNSHARED.name, t) for t in (0.5, 1.0)]
    cases += [Case(w, s, t) for w in WRONG for s in ("wide", "merged") for t in (0.5, 1.0)]
    return cases


def shape_named(name: str) -> Shape:
    return UNSHARED if name == UNSHARED.name else SHAPES[name]


def pair_for(shape: Shape) -> Pair:
    return make_pair(shape.vocab, seed=1000 + shape.vocab)


def run_case(case: Case, samples: int, seed: int = 0, device: str = "cpu") -> CaseResult:
    """Simulate `samples` trials of a case and test their joint output distribution. Each case draws
    its own randomness (seeded by its label), so the p-values of different cases are independent.
    device: where verification runs (cuda: the sync-free device path)."""
    shape = shape_named(case.shape)
    pair = pair_for(shape)
    rules = WRONG.get(case.algorithm, EXACT)
    case_seed = seed * 100_003 + zlib.crc32(case.label().encode()) % 100_000
    out = simulate(case.mode, pair, shape, case.params, samples, case_seed, rules, device)
    expected = joint_probs(reference_probs(pair, case.params), START_TOKEN, shape.measure)
    pval = chi2_pvalue(out.counts, expected)
    passed = (pval >= ALPHA) if case.expected_exact else (pval < ALPHA)
    return CaseResult(
        case.algorithm,
        case.shape,
        case.temperature,
        samples,
        pval,
        case.expected_exact,
        passed,
        case.top_k,
        case.top_p,
        out.first_round_tokens / samples,
    )


# --------------------------------------------------------------------------- acceptance
def tokens_per_round(
    modes: Sequence[str], shape: Shape, params: SamplingParams, trials: int, seed: int
) -> dict[str, torch.Tensor]:
    """Tokens emitted by one round (bonus included) per trial, from random last tokens, for each
    mode. Modes whose trees are of one kind verify the SAME sampled trees (e.g. mss and naive)."""
    pair = pair_for(shape)
    out: dict[str, torch.Tensor] = {}
    by_kind: dict[str, list[str]] = {}
    for mode in modes:
        by_kind.setdefault(TREE_KIND[mode], []).append(mode)
    for kind, kmodes in by_kind.items():
        gen = torch.Generator().manual_seed(seed)
        root = torch.randint(0, pair.vocab, (trials,), generator=gen)
        rnd = draw_round(pair, shape, kind, root, gen)
        logits = pair.target[torch.cat([root.unsqueeze(1), rnd.tokens], 1)]
        batch = rnd.batch(np.full(trials, START_LEN, dtype=np.int64))
        for mode in kmodes:
            res = verify_batch(mode, batch, logits, params, seeds=seed + np.arange(trials), generator=gen)
            out[mode] = (res.num_accepted + 1).double()
    return out


# --------------------------------------------------------------------------- timing
TIMING_EXPANSION = (2, 1, 2, 2, 1, 1, 1, 1, 1, 1)  # 64 nodes, depth 10
TIMING_VOCAB = 49_152
TIMING_NOTE = (
    "tree <2,1,2,2,1,1,1,1,1,1> (64 nodes, depth 10), V=49152; target logits N(0, 2^2) with one token "
    "per row raised by 16 (p_max 0.8-0.99); draft q = the same logits + N(0, 0.5^2), top-64, u16; "
    "children drawn from q (mss/naive with replacement, rrs without, greedy/match: q's top tokens)"
)


def timing_setup(seed: int = 1) -> tuple[torch.Tensor, dict[str, TokenTree]]:
    """The fixed timing tree for each tree kind, and the target logits of its 65 rows."""
    rng = np.random.default_rng(seed)
    parents = ExpansionConfig(TIMING_EXPANSION).parents()
    n = parents.size
    logits = rng.normal(size=(n + 1, TIMING_VOCAB)) * 2.0
    logits[np.arange(n + 1), rng.integers(0, TIMING_VOCAB, n + 1)] += 16.0
    noisy = logits + rng.normal(size=logits.shape) * 0.5
    row_parent, qrow = _rows_of(parents)
    qs = []
    for p in row_parent:
        z = noisy[p + 1]
        qs.append(SparseDist.from_probs(np.exp(z - z.max()), top_k=64))
    rows = SparseRows.from_rows(qs)
    trees = {}
    for kind in ("distinct", "replacement", "without"):
        tokens = np.zeros(n, dtype=np.int64)
        for r, p in enumerate(row_parent):
            kids = np.flatnonzero(parents == p)
            q = qs[r]
            if kind == "replacement":
                tokens[kids] = q.sample(rng, kids.size)
            elif kind == "without":
                tokens[kids] = q.sample_without_replacement(rng, kids.size)
            else:
                tokens[kids] = q.ids[np.argsort(-q.weights, kind="stable")[: kids.size]]
        draws = Draws(np.arange(n, dtype=np.int32), np.zeros(n, np.int32), qrow, rows)
        trees[kind] = TokenTree.build(
            tokens,
            parents,
            base=START_LEN - 1,
            cond=[START_TOKEN],
            draws=None if kind == "distinct" else draws,
        )
    return torch.from_numpy(logits.astype(np.float32)), trees


def time_verify(
    params: SamplingParams, reps: int, min_depth: int = 6
) -> tuple[dict[str, float], dict[str, int]]:
    """Median ms of one verify_tree call per mode on the timing tree, and the walked depth.

    Each call reseeds the generator (and the match seed) so it walks the same path; the seed is
    the first that walks at least `min_depth` nodes deep."""
    logits, trees = timing_setup()
    ms: dict[str, float] = {}
    walked: dict[str, int] = {}
    for mode, kind in TREE_KIND.items():
        tree = trees[kind]
        seed = 0
        for seed in range(200):
            res = verify_tree(
                mode, tree, logits, params, seed=seed, generator=torch.Generator().manual_seed(seed)
            )
            if len(res.accepted_nodes) >= min_depth:
                break
        walked[mode] = len(res.accepted_nodes)
        times = []
        for _ in range(reps):
            gen = torch.Generator().manual_seed(seed)
            t0 = time.perf_counter()
            verify_tree(mode, tree, logits, params, seed=seed, generator=gen)
            times.append((time.perf_counter() - t0) * 1e3)
        ms[mode] = statistics.median(times)
    return ms, walked


# --------------------------------------------------------------------------- CLI
def _format_p(p: float) -> str:
    return f"{p:.3g}" if p >= 1e-300 else "0"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.verify_exactness",
        description="Chi-square proof of exactness for every verification algorithm (and power against "
        "three wrong variants), tokens per round, and verify latency on a 64-node tree.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument("--samples", type=int, default=200_000, help="trials per case")
    ap.add_argument("--json", default=None, help="also write the results as JSON to this path")
    ap.add_argument("--seed", type=int, default=0, help="base seed of every case")
    ap.add_argument(
        "--acceptance-trials", type=int, default=100_000, help="trials per shape for tokens/round"
    )
    ap.add_argument("--timing-reps", type=int, default=200, help="verify_tree calls timed per algorithm")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--skip-timing", action="store_true", help="do not time verify_tree")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    results = []
    for case in tqdm(full_matrix(), desc="cases", unit="case"):
        results.append(run_case(case, args.samples, args.seed))
    print(f"\nJoint output distribution vs the target alone (Pearson chi-square, reject at p < {ALPHA:g})")
    head = f"{'algorithm':<28}{'shape':<15}{'T':>4}{'top-k/p':>10}{'samples':>9}{'p-value':>11}"
    head += "  expected  passed"
    print(head)
    print("-" * len(head))
    for r in results:
        tkp = f"{r.top_k}/{r.top_p:g}" if r.top_k or r.top_p < 1 else "-"
        exp = "exact" if r.expected_exact else "reject"
        print(
            f"{r.algorithm:<28}{r.shape:<15}{r.temperature:>4g}{tkp:>10}{r.samples:>9}"
            f"{_format_p(r.p_value):>11}  {exp:<8}  {'yes' if r.passed else 'NO'}"
        )

    modes = ["greedy", "match", "naive", "mss", "rrs"]
    per_mode: dict[str, list[float]] = {m: [] for m in modes}
    print("\nTokens per round (bonus included), one round from random last tokens")
    print(f"{'shape':<11}{'T':>4}" + "".join(f"{m:>9}" for m in modes))
    for shape in SHAPES.values():
        for temp in (0.5, 1.0):
            tpr = tokens_per_round(modes, shape, SamplingParams(temp), args.acceptance_trials, args.seed)
            row = {m: float(tpr[m].mean()) for m in modes}
            for m in modes:
                per_mode[m].append(row[m])
            print(f"{shape.name:<11}{temp:>4g}" + "".join(f"{row[m]:>9.3f}" for m in modes))
    acceptance = {m: float(np.mean(v)) for m, v in per_mode.items()}
    print(f"{'mean':<15}" + "".join(f"{acceptance[m]:>9.3f}" for m in modes))

    verify_ms: dict[str, float] = {}
    verify_ms_top_p: dict[str, float] = {}
    if not args.skip_timing:
        verify_ms, walked = time_verify(SamplingParams(1.0), args.timing_reps)
        verify_ms_top_p, walked_p = time_verify(SamplingParams(1.0, top_p=0.9), args.timing_reps)
        print(f"\nverify_tree median ms ({args.threads} thread(s)); {TIMING_NOTE}")
        print(f"{'':<22}" + "".join(f"{m:>9}" for m in modes))
        print(f"{'T=1 top-p 1 (ms)':<22}" + "".join(f"{verify_ms[m]:>9.3f}" for m in modes))
        print(f"{'  walked depth':<22}" + "".join(f"{walked[m]:>9d}" for m in modes))
        print(f"{'T=1 top-p 0.9 (ms)':<22}" + "".join(f"{verify_ms_top_p[m]:>9.3f}" for m in modes))
        print(f"{'  walked depth':<22}" + "".join(f"{walked_p[m]:>9d}" for m in modes))

    ok = all(r.passed for r in results)
    print(f"\n{sum(r.passed for r in results)}/{len(results)} cases passed")
    if args.json:
        doc = {
            "cases": [
                {
                    k: v
                    for k, v in asdict(r).items()
                    if k
                    in (
                        "algorithm",
                        "shape",
                        "temperature",
                        "top_k",
                        "top_p",
                        "samples",
                        "p_value",
                        "expected_exact",
                        "passed",
                    )
                }
                for r in results
            ],
            "acceptance": acceptance,
            "verify_ms": verify_ms,
            "verify_ms_top_p_0.9": verify_ms_top_p,
            "timing_tree": TIMING_NOTE,
        }
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=2)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
