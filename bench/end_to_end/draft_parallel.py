"""Drafting a merged round with several drafters in turn against at the same time (--parallel-drafters):
the ms to draft one merged round with several drafters, in turn vs at the same time.

No verifier: for each prompt the drafters are synced to the prompt and then to the first drafter's
greedy continuation, one token at a time, and at each position every variant drafts one round's
tree (a dynamic tree of --nodes nodes per drafter): each drafter `alone`, all of them `in_turn`
(merged, one drafting thread) and `parallel` (merged, a thread per drafter, each drafter on one
thread as always). Reports the median milliseconds of one round per variant; greedy, so in_turn
and parallel must give the same merged trees (checked). On a device with a free core per drafter,
`parallel` should cost about the slowest drafter alone instead of the sum.

    python -m bench draft_parallel --draft qwen2.5-coder-0.5b-q4 --draft DIR --drafter llama_cpp \
        --drafter onnx --nodes 8 --prompts 8 --positions 16 --json bench/out/draft_parallel.json
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import statistics
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
from tqdm import tqdm

from bench.harness import BenchPrompt, add_common_args, table
from bench.lib import runner
from bench.lib.args import add_model_args, suite_from_args
from bench.lib.runner import Result, UsageError
from edge_client.drafters.base import Drafter
from edge_client.drafters.registry import create_drafter
from edge_client.speculation import DraftPlain, DraftStep, Request, TreeSpec
from edge_client.trees import DraftResult
from shared.messages import Mode, SessionLimits


def _round_ms(step: DraftStep, committed: tuple[int, ...], nodes: int) -> tuple[float, DraftResult]:
    t0 = time.perf_counter()
    out = step.run(DraftPlain(committed, nodes))
    assert isinstance(out, DraftResult)
    return 1e3 * (time.perf_counter() - t0), out


def measure(
    drafters: Sequence[Drafter], prompts: Sequence[BenchPrompt], a: argparse.Namespace
) -> dict[str, Any]:
    shape = TreeSpec("budget", budget=a.nodes)
    req, limits = Request(Mode.GREEDY, shape), SessionLimits(max_nodes=64)
    n = len(drafters)
    pool = concurrent.futures.ThreadPoolExecutor(n - 1, thread_name_prefix="drafter-more")
    steps = {
        **{f"alone {i}": DraftStep([d], req, limits) for i, d in enumerate(drafters)},
        "in_turn": DraftStep(drafters, req, limits, [shape] * n),
        "parallel": DraftStep(drafters, req, limits, [shape] * n, pool),
    }
    ms: dict[str, list[float]] = {v: [] for v in steps}
    same = 0
    try:
        for p in tqdm(prompts, desc="prompts", disable=a.no_progress):
            seq = tuple(drafters[0].tokenizer.encode(p.text, parse_special=not p.raw))
            for _ in range(a.positions):
                trees = {}
                for v, st in steps.items():  # variants interleaved at every position
                    for d in drafters:  # untimed: every variant starts from drafters synced to seq
                        d.sync(list(seq))
                    t, dr = _round_ms(st, seq, a.nodes)
                    ms[v].append(t)
                    trees[v] = (dr.tree.tokens.tolist(), dr.tree.parents.tolist())
                same += trees["in_turn"] == trees["parallel"]
                logits = drafters[0].sync(list(seq))
                seq = (*seq, int(np.argmax(logits)))
    finally:
        pool.shutdown(wait=True)
    rounds = len(ms["in_turn"])
    return {
        "median_ms": {v: statistics.median(x) for v, x in ms.items()},
        "rounds": rounds,
        "identical_trees": same,
    }


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--draft", action="append", required=True, help="a draft (alias, GGUF or export folder); repeat"
    )
    ap.add_argument("--drafter", action="append", default=None, help="backend per --draft (or one for all)")
    ap.add_argument("--nodes", type=int, default=8, help="nodes of each drafter's dynamic tree")
    ap.add_argument("--prompts", type=int, default=8, help="Spec-Bench prompts")
    ap.add_argument("--humaneval", type=int, default=0, help="HumanEval prompts")
    ap.add_argument("--positions", type=int, default=16, help="rounds drafted per prompt (positions)")
    add_model_args(ap, threads=1, threads_help="threads per llama.cpp / onnx drafter")
    add_common_args(
        ap, json=True, json_help="the median ms of each variant", prompt_file=True, no_progress=True
    )


def run(a: argparse.Namespace) -> Result:
    backends = a.drafter or ["llama_cpp"]
    if len(a.draft) < 2:
        raise UsageError("give two or more --draft")
    if len(backends) not in (1, len(a.draft)):
        raise UsageError(f"--drafter: give one backend, or one per --draft ({len(a.draft)})")
    if a.nodes < 1 or a.positions < 1 or a.prompts + a.humaneval < 1:
        raise UsageError("--nodes, --positions and the prompt count must be positive")
    backends = backends * len(a.draft) if len(backends) == 1 else backends
    prompts = suite_from_args(a.humaneval, a.prompts, a.prompt_file)
    drafters = [
        create_drafter(b, d, n_threads=a.threads, max_context=4096, max_nodes=64)
        for b, d in zip(backends, a.draft, strict=True)
    ]
    try:
        res = measure(drafters, prompts, a)
    finally:
        for d in drafters:
            d.close()
    med = res["median_ms"]
    alone = [v for v in med if v.startswith("alone")]
    text = "\n".join(
        [
            table([[v, med[v]] for v in med], ["variant", "ms a round (median)"]),
            f"parallel / in_turn {med['parallel'] / med['in_turn']:.2f}; parallel / slowest alone "
            f"{med['parallel'] / max(med[v] for v in alone):.2f}; identical merged trees "
            f"{res['identical_trees']}/{res['rounds']}",
        ]
    )
    out = [{"variant": v, "median_ms": med[v]} for v in med]
    return Result(out, text, extra={**res, "drafter": backends, "cores": os.cpu_count()})


def main(argv: Sequence[str] | None = None) -> int:
    return runner.main(__name__, argv)


if __name__ == "__main__":
    raise SystemExit(main())
