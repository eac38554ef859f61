"""Tokens per round of the TypeScript client's prompt-lookup drafter (clients/typescript), and its
output identity with target-only decoding, on HumanEval and Spec-Bench dev prompts.

    python -m bench lookup_tau --model smollm2-135m --humaneval 10 --prompts 10 --tokens 128

Starts the verifier, tokenizes each prompt with the target's tokenizer (HumanEval raw, Spec-Bench in
the chat template), runs the TypeScript CLI in greedy mode and then in `ar` mode, and reports τ per
category and whether every output equals `ar`. Needs Node 20 and npm (the client is built first).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from bench.harness import REPO, Verifier, add_common_args, table
from bench.lib import runner
from bench.lib.args import add_model_args, suite_from_args
from bench.lib.runner import Result, UsageError

TS = REPO / "clients" / "typescript"


def add_args(ap: argparse.ArgumentParser) -> None:
    add_model_args(ap, model="smollm2-135m")
    ap.add_argument("--humaneval", type=int, default=10, help="HumanEval dev prompts (raw)")
    ap.add_argument("--prompts", type=int, default=10, help="Spec-Bench dev prompts (chat template)")
    ap.add_argument("--depth", type=int, default=8, help="prompt lookup: tokens per guess")
    ap.add_argument("--width", type=int, default=3, help="prompt lookup: guesses merged into the tree")
    add_common_args(
        ap,
        json=True,
        json_help="rows: one per prompt; the summary's figures beside them",
        tokens=128,
        prompt_file=True,
        no_progress=True,
    )


def run(a: argparse.Namespace) -> Result:
    prompts = suite_from_args(a.humaneval, a.prompts, a.prompt_file)
    if shutil.which("node") is None or shutil.which("npm") is None:
        raise UsageError("needs Node.js 20 and npm (the TypeScript client)")
    if not (TS / "node_modules").exists():
        subprocess.run(["npm", "ci", "--no-audit", "--no-fund"], cwd=TS, check=True, capture_output=True)
    subprocess.run(["npm", "run", "build"], cwd=TS, check=True, capture_output=True)
    from shared.model import load_target

    target = load_target(a.model, progress=False)
    tok = target.tokenizer
    rows: list[dict[str, Any]] = []
    with Verifier(a.model, threads=2, args=["--max-context", "4096"]) as v:
        for p in tqdm(prompts, desc="prompts", file=sys.stderr, disable=a.no_progress):
            text = p.text if p.raw else tok.apply_chat_template([{"role": "user", "content": p.text}])
            ids = tok.encode(text, add_special=p.raw)
            out = {}
            for mode in ("greedy", "ar"):
                cmd = [
                    "node",
                    "dist/src/cli.js",
                    "--server",
                    v.url,
                    "--fingerprint",
                    target.vocab_fingerprint,
                ]
                cmd += ["--prompt-ids", ",".join(map(str, ids)), "--mode", mode]
                cmd += [
                    "--max-new-tokens",
                    str(a.tokens),
                    "--depth",
                    str(a.depth),
                    "--width",
                    str(a.width),
                    "--json",
                ]
                res = subprocess.run(cmd, cwd=TS, capture_output=True, text=True, timeout=600, check=True)
                out[mode] = json.loads(res.stdout)
            st = out["greedy"]["stats"]
            rows.append({"prompt": str(p.question_id), "category": p.category, "tau": st["tau"],
                         "rounds": st["rounds"], "tokens": st["tokens"],
                         "identical": out["greedy"]["tokens"] == out["ar"]["tokens"]})  # fmt: skip
    by_cat: dict[str, list[float]] = {}
    for row in rows:
        by_cat.setdefault(str(row["category"]), []).append(float(row["tau"]))
    he = [float(row["tau"]) for row in rows if row["category"] == "humaneval"]
    sb = [float(row["tau"]) for row in rows if row["category"] != "humaneval"]
    summary = {
        "model": a.model,
        "tokens": a.tokens,
        "tau_humaneval_mean": round(statistics.mean(he), 3) if he else None,
        "tau_spec_bench_mean": round(statistics.mean(sb), 3) if sb else None,
        "identical_to_ar": all(bool(row["identical"]) for row in rows),
        "tau_by_category": {c: round(statistics.mean(v), 3) for c, v in sorted(by_cat.items())},
    }
    text = "\n".join([table([[c, len(v), f"{statistics.mean(v):.2f}"] for c, v in sorted(by_cat.items())],
                            ["category", "prompts", "tau"]),
                      json.dumps({k: v for k, v in summary.items() if k != "tau_by_category"})])  # fmt: skip
    return Result(rows, text, extra=summary, status=0 if summary["identical_to_ar"] else 1)


def main(argv: Sequence[str] | None = None) -> int:
    return runner.main(__name__, argv)


if __name__ == "__main__":
    sys.exit(main())
