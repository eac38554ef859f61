"""The TypeScript edge against the Python edge, with the same ONNX export, on the same verifier.

Both edges draft with the same export (`edge-client export-onnx`, here made on first use) and the
same static tree, greedy, one prompt at a time against one `cloud-verifier serve` (edge and
verifier on disjoint cores), directly (RTT 0) or through the TCP delay proxy (bench.netproxy) at
each `--rtt-ms`. Per edge and RTT: tau, ms/token, the median ms of drafting a round's tree on the
critical path, and whether the output equals the other edge's (both must be the target's greedy
output). Node, npm and a built clients/typescript are needed (`npm ci && npm run build` there).

    python -m bench.js_edge --prompts 4 --humaneval 4 --tokens 64 --rtt-ms 0,50 --json out.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import statistics
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tqdm import tqdm

from bench.harness import (
    REPO,
    CoreSplit,
    Verifier,
    add_common_args,
    nonnegative_ints,
    suite_from_args,
    table,
    write_result,
)
from bench.network import Proxy

TS = REPO / "clients" / "typescript"


def run_edge(edge: str, url: str, export: Path, prompt: str, raw: bool, tokens: int, tree: str,
             pin: Callable[[], None]) -> dict[str, Any]:  # fmt: skip
    """One generation by the `ts` or `py` edge's CLI; its tokens and figures."""
    if edge == "ts":
        cmd = ["node", str(TS / "dist" / "src" / "cli.js"), "generate", "--server", url]
        cmd += ["--draft", str(export), "--tree", tree, "--max-new-tokens", str(tokens), "--json"]
    else:
        cmd = [sys.executable, "-m", "edge_client", "generate", "--server", url, "--drafter", "onnx"]
        cmd += [
            "--draft",
            str(export),
            "--tree",
            tree,
            "--max-tokens",
            str(tokens),
            "--threads",
            "1",
            "--json",
        ]
    cmd += ["--raw", prompt] if raw else [prompt]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900, preexec_fn=pin, cwd=REPO)
    if r.returncode != 0:
        raise RuntimeError(f"{edge} edge failed ({r.returncode}): {r.stderr[-2000:]}")
    doc = json.loads(r.stdout.strip().splitlines()[-1])
    st = doc["stats"]
    if edge == "ts":
        return {
            "tokens": doc["tokens"],
            "tau": st["tau"],
            "ms_per_token": st["msPerToken"],
            "draft_ms": st["draftMs"],
        }
    return {
        "tokens": doc["tokens"],
        "tau": st["tau"],
        "ms_per_token": st["ms_per_token"],
        "draft_ms": st["draft_ms"],
    }


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.js_edge",
        description="The TypeScript edge (onnxruntime-node) against the Python edge (onnxruntime), the same "
        "ONNX export and tree: tau, ms/token and drafting ms a round, at each RTT.",
    )
    ap.add_argument("--model", default="smollm2-135m", help="the verifier's target")
    ap.add_argument("--draft", default="smollm2-135m-q4", help="the draft exported to ONNX (alias or GGUF)")
    ap.add_argument("--int8", action="store_true", help="the int8 export (8-bit blocks) instead of fp32")
    ap.add_argument("--humaneval", type=int, default=4, help="HumanEval dev prompts (raw)")
    ap.add_argument("--prompts", type=int, default=4, help="Spec-Bench dev prompts (chat)")
    ap.add_argument(
        "--rtt-ms", type=nonnegative_ints, default=[0, 50], help="round trips (0: direct; else via the proxy)"
    )
    ap.add_argument("--tree", default="1,1,3,1,1,1,1,1", help="the static expansion tree both edges draft")
    add_common_args(ap, json=True, json_help="rows: one per edge and RTT", tokens=64,
                    tokens_help="new tokens per prompt", prompt_file=True, no_progress=True)  # fmt: skip
    a = ap.parse_args(argv)
    if shutil.which("node") is None or not (TS / "dist" / "src" / "cli.js").exists():
        ap.error(
            "needs Node 20 and the built TypeScript client: cd clients/typescript && npm ci && npm run build"
        )
    from edge_client.onnx.export import ensure_export

    export = ensure_export(a.draft, int8=a.int8, progress=not a.no_progress)
    prompts = suite_from_args(ap, a.humaneval, a.prompts, a.prompt_file)
    split = CoreSplit.auto()
    print(split.describe(), file=sys.stderr)
    rows: list[dict[str, Any]] = []
    with Verifier(a.model, cores=split.verifier, echo=not a.no_progress).start() as ver:
        bar = tqdm(
            total=len(a.rtt_ms) * len(prompts) * 2, desc="js_edge", file=sys.stderr, disable=a.no_progress
        )
        for rtt in a.rtt_ms:
            with contextlib.ExitStack() as stack:
                url = ver.url
                if rtt:
                    proxy = stack.enter_context(Proxy(ver.port, rtt, 0.0, 0.0, split.edge))
                    url = proxy.url
                per: dict[str, list[dict[str, Any]]] = {"ts": [], "py": []}
                for p in prompts:
                    for edge in ("ts", "py"):
                        per[edge].append(
                            run_edge(edge, url, export, p.text, p.raw, a.tokens, a.tree, split.pin_edge)
                        )
                        bar.update()
            same = [t["tokens"] == q["tokens"] for t, q in zip(per["ts"], per["py"], strict=True)]
            for edge, runs in per.items():
                rows.append(
                    {
                        "edge": "typescript (onnxruntime-node)" if edge == "ts" else "python (onnxruntime)",
                        "rtt_ms": rtt,
                        "tau": round(statistics.mean(r["tau"] for r in runs), 3),
                        "ms_per_token": round(statistics.median(r["ms_per_token"] for r in runs), 2),
                        "draft_ms_per_round": round(statistics.median(r["draft_ms"] for r in runs), 2),
                        "identical_outputs": f"{sum(same)}/{len(same)}",
                    }
                )
            write_result(a.json, a, rows, False, export=str(export))
        bar.close()
    print(table([[r["edge"], r["rtt_ms"], r["tau"], r["ms_per_token"], r["draft_ms_per_round"],
                  r["identical_outputs"]] for r in rows],
                ["edge", "rtt ms", "tau", "ms/token", "draft ms/round", "same output"]))  # fmt: skip
    write_result(a.json, a, rows, True, export=str(export))
    return 0


if __name__ == "__main__":
    sys.exit(main())
