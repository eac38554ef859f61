"""`make demo`: the verifier and the edge client on localhost, on a real model pair.

Starts `cloud-verifier serve --model smollm2-135m` (fp32 torch) on its own core, drafts with
llama.cpp on the other (the packaged SmolLM2 Q4 GGUF, then the weak 8-block draft), streams the
text of a few Spec-Bench prompts and prints target-only AR vs sequence vs tree speculation.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence

from bench.e2e import report, run_modes
from bench.harness import CoreSplit, Verifier, load_prompts, table
from edge_client.drafters.registry import create_drafter
from shared.messages import Mode
from shared.tree import ExpansionConfig

DRAFTS = ("smollm2-135m-q4", "smollm2-135m-q4-l8")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.demo", description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=3, help="Spec-Bench prompts to run")
    ap.add_argument("--tokens", type=int, default=48, help="new tokens per prompt")
    ap.add_argument("--model", default="smollm2-135m", help="target model of the verifier")
    a = ap.parse_args(argv)
    split = CoreSplit.auto()
    print(
        f"Demo: verifier ({a.model}, fp32 torch) + edge client (llama.cpp drafts "
        f"{', '.join(DRAFTS)}) on localhost,\n"
        f"{a.prompts} Spec-Bench prompts x {a.tokens} tokens, greedy; output is exactly the target's.\n"
        + split.describe(),
        flush=True,
    )
    prompts = load_prompts(a.prompts)
    tree = ExpansionConfig()
    print("starting the verifier (loads and dequantizes the GGUF, measures its cost curve) ...", flush=True)
    rows: list[list[object]] = []
    with Verifier(a.model, cores=split.verifier, threads=len(split.verifier)) as verifier:
        split.pin_edge()
        for k, draft in enumerate(DRAFTS):
            drafter = create_drafter("llama_cpp", draft, n_threads=1)
            modes = ("ar", "sequence", "tree") if k == 0 else ("sequence", "tree")
            print(f"\n=== draft {draft}: tree {tree} ===", flush=True)

            seen: set[int] = set()

            def show(mode: str, i: int, chunk: str, seen: set[int] = seen) -> None:
                if mode != "tree":
                    return
                if i not in seen:
                    seen.add(i)
                    print(f"\n[{prompts[i].category}] {prompts[i].text[:100]}\n> ", end="", flush=True)
                print(chunk, end="", flush=True)

            try:
                runs, by_cat = asyncio.run(
                    run_modes(
                        verifier.url,
                        drafter,
                        prompts,
                        a.tokens,
                        0.0,
                        Mode.GREEDY,
                        tree,
                        verifier.forwards,
                        on_chunk=show,
                        modes=modes,
                        progress=False,
                    )
                )
            finally:
                drafter.close()
            res = report(runs, by_cat, exact=True)
            print(f"\n(identical to target-only AR: {res['identical_to_ar']})" if k == 0 else "", flush=True)
            for m, s in res["modes"].items():
                rows.append(
                    [
                        m if m == "ar" else f"{m} ({draft})",
                        s["ms_per_token"],
                        s["tau"],
                        s["target_forwards_per_token"],
                    ]
                )
    print()
    print(table(rows, ["mode", "ms/token", "tau", "target forwards/token"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
