"""Chi-square proof of exactness for every verification algorithm (and power against three wrong
variants), tokens per round, and verify latency on a 64-node tree.

`python -m bench verify_exactness [--samples N] [--json PATH]` runs the full matrix: algorithms x
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
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from bench.harness import add_common_args
from bench.lib import runner
from bench.lib.args import add_model_args
from bench.lib.runner import Result
from cloud_verifier.exactness import (
    ALPHA,
    SHAPES,
    full_matrix,
    run_case,
    tokens_per_round,
)
from cloud_verifier.exactness.rounds import START_LEN, START_TOKEN, TREE_KIND, rows_of
from cloud_verifier.sampling import SamplingParams
from cloud_verifier.verify import Algorithm, verify_tree
from shared.sparse import SparseDist, SparseRows
from shared.tree import Draws, ExpansionConfig, TokenTree

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
    row_parent, qrow = rows_of(parents)
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
                Algorithm(mode),
                tree,
                logits,
                params,
                seed=seed,
                generator=torch.Generator().manual_seed(seed),
            )
            if len(res.accepted_nodes) >= min_depth:
                break
        walked[mode] = len(res.accepted_nodes)
        times = []
        for _ in range(reps):
            gen = torch.Generator().manual_seed(seed)
            t0 = time.perf_counter()
            verify_tree(Algorithm(mode), tree, logits, params, seed=seed, generator=gen)
            times.append((time.perf_counter() - t0) * 1e3)
        ms[mode] = statistics.median(times)
    return ms, walked


# --------------------------------------------------------------------------- CLI
# the fields of a case in the JSON's rows
CASE_KEYS = (
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


def _format_p(p: float) -> str:
    return f"{p:.3g}" if p >= 1e-300 else "0"


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--samples", type=int, default=200_000, help="trials per case")
    add_common_args(
        ap,
        json=True,
        json_help="rows: the chi-square cases (also as cases); acceptance, verify_ms",
        seed=0,
        seed_help="base seed of every case",
        no_progress=True,
    )
    ap.add_argument(
        "--acceptance-trials", type=int, default=100_000, help="trials per shape for tokens/round"
    )
    ap.add_argument("--timing-reps", type=int, default=200, help="verify_tree calls timed per algorithm")
    add_model_args(ap, threads=1, threads_help="torch intra-op threads")
    ap.add_argument("--skip-timing", action="store_true", help="do not time verify_tree")


MODES = ["greedy", "match", "naive", "mss", "rrs"]


def chi_square_lines(results: Sequence[Any]) -> list[str]:
    """The chi-square table: one line per case."""
    lines = [f"\nJoint output distribution vs the target alone (Pearson chi-square, reject at p < {ALPHA:g})"]
    head = f"{'algorithm':<28}{'shape':<15}{'T':>4}{'top-k/p':>10}{'samples':>9}{'p-value':>11}"
    head += "  expected  passed"
    lines += [head, "-" * len(head)]
    for r in results:
        tkp = f"{r.top_k}/{r.top_p:g}" if r.top_k or r.top_p < 1 else "-"
        exp = "exact" if r.expected_exact else "reject"
        lines.append(
            f"{r.algorithm:<28}{r.shape:<15}{r.temperature:>4g}{tkp:>10}{r.samples:>9}"
            f"{_format_p(r.p_value):>11}  {exp:<8}  {'yes' if r.passed else 'NO'}"
        )
    return lines


def acceptance_lines(trials: int, seed: int) -> tuple[dict[str, float], list[str]]:
    """Tokens per round of each mode by shape and temperature, and the mean per mode: (the means,
    the printed lines)."""
    per_mode: dict[str, list[float]] = {m: [] for m in MODES}
    lines = ["\nTokens per round (bonus included), one round from random last tokens"]
    lines.append(f"{'shape':<11}{'T':>4}" + "".join(f"{m:>9}" for m in MODES))
    for shape in SHAPES.values():
        for temp in (0.5, 1.0):
            tpr = tokens_per_round(MODES, shape, SamplingParams(temp), trials, seed)
            row = {m: float(tpr[m].mean()) for m in MODES}
            for m in MODES:
                per_mode[m].append(row[m])
            lines.append(f"{shape.name:<11}{temp:>4g}" + "".join(f"{row[m]:>9.3f}" for m in MODES))
    acceptance = {m: float(np.mean(v)) for m, v in per_mode.items()}
    lines.append(f"{'mean':<15}" + "".join(f"{acceptance[m]:>9.3f}" for m in MODES))
    return acceptance, lines


def timing_lines(reps: int, threads: int) -> tuple[dict[str, float], dict[str, float], list[str]]:
    """verify_tree's median ms per mode at top-p 1 and 0.9, and the printed lines."""
    verify_ms, walked = time_verify(SamplingParams(1.0), reps)
    verify_ms_top_p, walked_p = time_verify(SamplingParams(1.0, top_p=0.9), reps)
    lines = [
        f"\nverify_tree median ms ({threads} thread(s)); {TIMING_NOTE}",
        f"{'':<22}" + "".join(f"{m:>9}" for m in MODES),
        f"{'T=1 top-p 1 (ms)':<22}" + "".join(f"{verify_ms[m]:>9.3f}" for m in MODES),
        f"{'  walked depth':<22}" + "".join(f"{walked[m]:>9d}" for m in MODES),
        f"{'T=1 top-p 0.9 (ms)':<22}" + "".join(f"{verify_ms_top_p[m]:>9.3f}" for m in MODES),
        f"{'  walked depth':<22}" + "".join(f"{walked_p[m]:>9d}" for m in MODES),
    ]
    return verify_ms, verify_ms_top_p, lines


def run(args: argparse.Namespace) -> Result:
    torch.set_num_threads(args.threads)
    results = []
    for case in tqdm(full_matrix(), desc="cases", unit="case", disable=args.no_progress):
        results.append(run_case(case, args.samples, args.seed))
    lines = chi_square_lines(results)
    acceptance, more = acceptance_lines(args.acceptance_trials, args.seed)
    lines += more
    verify_ms: dict[str, float] = {}
    verify_ms_top_p: dict[str, float] = {}
    if not args.skip_timing:
        verify_ms, verify_ms_top_p, more = timing_lines(args.timing_reps, args.threads)
        lines += more
    ok = all(r.passed for r in results)
    lines.append(f"\n{sum(r.passed for r in results)}/{len(results)} cases passed")
    cases = [{k: v for k, v in asdict(r).items() if k in CASE_KEYS} for r in results]
    extra = {"acceptance": acceptance, "verify_ms": verify_ms, "verify_ms_top_p_0.9": verify_ms_top_p}
    return Result(
        cases,
        "\n".join(lines),
        extra={"cases": cases, **extra, "timing_tree": TIMING_NOTE},
        status=0 if ok else 1,
    )


def main(argv: Sequence[str] | None = None) -> int:
    return runner.main(__name__, argv)


if __name__ == "__main__":
    sys.exit(main())
