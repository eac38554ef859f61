"""The exactness harness's simulation and cases: rounds repeat until each trial has emitted the
next `measure` tokens, batched over trials through the production `verify_batch`; their joint
frequency is compared with the exact joint distribution under the target alone by Pearson
chi-square. Deliberately wrong variants (WRONG) must be rejected by the same test."""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from cloud_verifier.exactness.rounds import (
    ALPHA,
    CHUNK,
    SHAPES,
    START_LEN,
    START_TOKEN,
    TREE_KIND,
    UNSHARED,
    Pair,
    Shape,
    draw_round,
    make_pair,
)
from cloud_verifier.exactness.stats import chi2_pvalue
from cloud_verifier.sampling import EXACT, Rules, SamplingParams, target_probs
from cloud_verifier.verify import Algorithm, BatchResult, TreeBatch, verify_batch
from shared.sparse import truncate


# --------------------------------------------------------------------------- simulation
@dataclass
class CaseOutcome:
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
) -> CaseOutcome:
    """Run `trials` independent generations from START_TOKEN until each emitted `shape.measure`
    tokens; count their joint values. Batched: every round verifies all unfinished trials at once.
    device: where verification runs (its logits, trees and generator; sync-free off the CPU);
    drafting stays on the host."""
    v, m = pair.vocab, shape.measure
    out = CaseOutcome(np.zeros(v**m, dtype=np.int64))
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
                Algorithm(mode),
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
        onehot: np.ndarray = np.eye(v)[logits.argmax(-1)]
        return onehot
    z = logits / params.temperature
    p: np.ndarray = np.exp(z - z.max(-1, keepdims=True))
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
    out: np.ndarray = p[start]
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
    shift = torch.tensor([-0.01, 0.01], dtype=p.dtype, device=p.device).expand(top.shape)
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
            res = verify_batch(
                Algorithm(mode), batch, logits, params, seeds=seed + np.arange(trials), generator=gen
            )
            out[mode] = (res.num_accepted + 1).double()
    return out
