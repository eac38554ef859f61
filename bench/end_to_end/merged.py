"""One drafter against several merged (SpecInfer Definition 3.2 at the edge), at equal total tree size.

Every variant drafts dynamic (best-first) trees of fixed sizes: `one` is the first draft alone
with --nodes nodes, `other` the second alone with --nodes, `merged` every draft with
--nodes / len(drafts) nodes each, drafted in turn and merged into one tree (identical paths
deduplicated in greedy / match, so a merged tree may hold fewer nodes: `nodes_per_round` against
--nodes is the drafts' redundancy). With --parallel, `merged_parallel` is the same merge with the
drafts drafting at the same time (EdgeClient's parallel_drafters, a thread each). `ar` is
target-only, the ms/token baseline and the exactness reference. Prompts are interleaved variant by
variant as in bench.end_to_end.e2e.

    python -m bench merged --model smollm2-135m --draft smollm2-135m-q4 --draft smollm2-135m-q4-l8 \\
        --nodes 16 --prompts 10 --humaneval 0 --tokens 64 --json bench/out/merged_smollm2.json
    python -m bench merged --model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b-q4 \\
        --draft qwen2.5-coder-0.5b-q4 --drafter llama_cpp --drafter torch --nodes 16 ...
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence
from typing import Any

from bench.end_to_end.e2e_results import ModeRuns
from bench.harness import BenchPrompt, CoreSplit, Verifier, add_common_args
from bench.lib import runner
from bench.lib.args import add_model_args, suite_from_args
from bench.lib.runner import Result, UsageError
from edge_client.client import EdgeClient, TreeSpec
from edge_client.drafters.registry import available_backends, create_drafter
from shared.messages import Mode
from shared.model_store import DEFAULT_TARGET


def variant_shapes(
    n_drafts: int, nodes: int, parallel: bool = False
) -> dict[str, tuple[list[int], list[TreeSpec]]]:
    """Variant name -> (indices of the drafts it uses, their tree shapes), at `nodes` nodes in all;
    `parallel` adds `merged_parallel` (the drafts of `merged`, drafted at the same time)."""
    if n_drafts < 2:
        raise ValueError("give at least two --draft to compare one drafter with merged ones")
    each = nodes // n_drafts
    if each < 1:
        raise ValueError(f"--nodes {nodes} cannot be split over {n_drafts} drafts")
    merged = (list(range(n_drafts)), [TreeSpec("budget", budget=each)] * n_drafts)
    return {
        "ar": ([0], [TreeSpec("budget", budget=nodes)]),
        "one": ([0], [TreeSpec("budget", budget=nodes)]),
        "other": ([1], [TreeSpec("budget", budget=nodes)]),
        "merged": merged,
        **({"merged_parallel": merged} if parallel else {}),
    }


async def run_variants(
    url: str, drafters: Sequence[Any], prompts: Sequence[BenchPrompt], a: argparse.Namespace
) -> tuple[dict[str, ModeRuns], dict[str, list[int]]]:
    shapes = variant_shapes(len(drafters), a.nodes, a.parallel)
    mode = Mode(a.mode)
    runs = {v: ModeRuns() for v in shapes}
    nodes: dict[str, list[int]] = {v: [] for v in shapes}  # tree nodes of every round
    clients = {
        v: EdgeClient(
            url,
            [drafters[i] for i in idx],
            tree=trees,
            api_key=a.api_key,
            parallel_drafters=v == "merged_parallel",
        )
        for v, (idx, trees) in shapes.items()
    }
    for c in clients.values():
        await c.connect()
    try:
        for c in clients.values():  # warm up both sides (first-call allocations, caches)
            async for _ in c.generate("Hello", max_new_tokens=4, mode=mode, temperature=a.temperature):
                pass
        for i, p in enumerate(prompts):
            for v, c in clients.items():
                m = Mode.AR if v == "ar" else mode
                kw = {"max_new_tokens": a.tokens, "temperature": a.temperature, "seed": a.seed + i}
                async for _ in c.generate(p.text, raw=p.raw, mode=m, **kw):
                    pass
                assert c.last is not None
                runs[v].add(c.last, 0.0, p)
                nodes[v].extend(c.last.stats.tree_nodes)
            print(f"prompt {i + 1}/{len(prompts)} done", file=sys.stderr, flush=True)
    finally:
        for c in clients.values():
            await c.close()
    return runs, nodes


def build_parser() -> argparse.ArgumentParser:
    return runner.build_parser(__name__)


def add_args(ap: argparse.ArgumentParser) -> None:
    add_model_args(ap, model=DEFAULT_TARGET, threads=1, threads_help="threads per llama.cpp drafter")
    ap.add_argument(
        "--draft",
        action="append",
        default=None,
        required=True,
        help="a draft alias or GGUF path; give it at least twice (the same model twice makes sense only "
        "under two --drafter backends, whose trees differ by their numerics)",
    )
    ap.add_argument(
        "--drafter",
        action="append",
        default=None,
        choices=available_backends(),
        help="draft backend: once for every --draft, or once per --draft in order (default llama_cpp)",
    )
    ap.add_argument("--nodes", type=int, default=16, help="total tree nodes per round in every variant")
    ap.add_argument(
        "--parallel",
        action="store_true",
        help="also run `merged_parallel`: the merged drafts drafting at the same time, a thread each "
        "(on the edge's cores: with one core they take turns on it)",
    )
    ap.add_argument("--prompts", type=int, default=10, help="Spec-Bench prompts")
    ap.add_argument("--humaneval", type=int, default=0, help="HumanEval prompts")
    ap.add_argument("--mode", default="greedy", choices=["greedy", "match"], help="verification mode")
    ap.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (match)")
    ap.add_argument("--url", default=None, help="a running verifier's session URL (default: start one)")
    ap.add_argument("--api-key", default=None, help="API key for --url")
    add_common_args(
        ap,
        json=True,
        json_help="rows: each variant's summary",
        seed=0,
        seed_help="seed of the first prompt (then +1 each)",
        tokens=64,
        prompt_file=True,
    )


def run(a: argparse.Namespace) -> Result:
    drafts = a.draft
    backends = a.drafter or ["llama_cpp"]
    if len(backends) not in (1, len(drafts)):
        raise UsageError(f"--drafter: give one backend, or one per --draft ({len(drafts)})")
    backends = backends * len(drafts) if len(backends) == 1 else backends
    try:
        variant_shapes(len(drafts), a.nodes, a.parallel)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    split = CoreSplit.auto()
    print(split.describe(), flush=True)
    prompts = suite_from_args(a.humaneval, a.prompts, a.prompt_file)
    verifier = None
    url = a.url
    if url is None:
        verifier = Verifier(a.model, cores=split.verifier, threads=len(split.verifier)).start()
        url = verifier.url
    split.pin_edge()
    drafters = [
        create_drafter(b, d, **({"n_threads": a.threads} if b == "llama_cpp" else {}))
        for b, d in zip(backends, drafts, strict=True)
    ]
    try:
        runs, nodes = asyncio.run(run_variants(url, drafters, prompts, a))
    finally:
        for d in drafters:
            d.close()
        if verifier is not None:
            verifier.stop()
    ar = runs["ar"].tokens
    result: dict[str, Any] = {
        "config": {
            **{k: v for k, v in vars(a).items() if k != "api_key"},
            "draft": drafts,
            "drafter": backends,
        },
        "variants": {v: r.summary() for v, r in runs.items()},
        "nodes_per_round": {v: round(sum(n) / len(n), 2) if n else 0.0 for v, n in nodes.items()},
        # greedy and seeded match are exact: every variant's tokens are ar's (up to near-ties)
        "identical_to_ar": {v: r.tokens == ar for v, r in runs.items() if v != "ar"},
    }
    lines = [f"{'variant':15} {'tau':>6} {'ms/token':>9} {'nodes/round':>12}"]
    for v, r in runs.items():
        s = r.summary()
        per_round = sum(nodes[v]) / len(nodes[v]) if nodes[v] else 0.0
        lines.append(f"{v:15} {s['tau_pooled']:6.2f} {s['ms_per_token']:9.1f} {per_round:12.1f}")
    lines.append(f"identical to ar: {result['identical_to_ar']}")
    rows = [
        {"variant": v, **summary, "nodes_per_round": result["nodes_per_round"][v]}
        for v, summary in result["variants"].items()
    ]
    return Result(rows, "\n".join(lines), config=result.pop("config"), extra=result)


def main(argv: Sequence[str] | None = None) -> int:
    return runner.main(__name__, argv)


if __name__ == "__main__":
    raise SystemExit(main())
