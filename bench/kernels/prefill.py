"""Prompt tokens per second of the quantized target against llama.cpp's prompt processing, on the
same GGUF and the same thread counts.

`python -m bench prefill` times:

- ours: `shared.model.prefill` (causal chunks of up to 512 rows through `forward_packed`, the
  projections on the file's own blocks: the multi-row tiles of treespec_kernels.quant_matmul,
  VNNI or AMX where the CPU has them), a fresh sequence per repeat, the logits of the last row;
- llama.cpp: `llama-bench -p P -n 0 -t T` (its prompt-processing test, batch = the prompt),
  built from the llama.cpp source the installed llama-cpp-python vendors (bench.lib.llama_tools).

Rows: one per (system, threads, prompt length): median ms and prompt tokens/s, and ours over
llama.cpp. Random token ids (both systems' cost does not depend on which tokens).

    python -m bench prefill --json prefill.json
    python -m bench prefill --threads 1 --lengths 64 --systems ours
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the other benches: no spinning waiters

import argparse
import json
import statistics
import subprocess
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from bench.lib import runner
from bench.lib.args import add_common_args, add_model_args, positive_ints
from bench.lib.results import table
from shared.model_store import DEFAULT_TARGET

SYSTEMS = ("ours", "llama.cpp")


def add_args(ap: argparse.ArgumentParser) -> None:
    add_model_args(ap, model=DEFAULT_TARGET, model_help="a GGUF target: model alias or path")
    ap.add_argument("--threads", type=positive_ints, default=[1, 2], help="thread counts, comma-separated")
    ap.add_argument(
        "--lengths", type=positive_ints, default=[64, 256], help="prompt lengths, comma-separated"
    )
    ap.add_argument("--repeats", type=int, default=3, help="timed prefills per cell (the median is shown)")
    ap.add_argument("--systems", default=",".join(SYSTEMS), help=f"which to run, from {','.join(SYSTEMS)}")
    add_common_args(ap, json=True, json_help="rows: one per (system, threads, length)", no_progress=True)


def ours(
    model: str, threads: Sequence[int], lengths: Sequence[int], repeats: int, bar: Any
) -> list[dict[str, Any]]:
    """Median ms of a prefill of each length on each thread count."""
    from shared.model import load_target, prefill

    target = load_target(model, weights="quantized")
    rng = np.random.default_rng(0)
    kv = target.new_kv_cache(-(-max(lengths) // 16) + 4)
    before = torch.get_num_threads()
    rows = []
    for t in threads:
        torch.set_num_threads(t)
        for n in lengths:
            tokens = rng.integers(3, target.config.vocab_size, n).tolist()
            times = []
            for rep in range(repeats + 1):  # the first warms up
                kv.add(0)
                t0 = time.perf_counter()
                prefill(target.model, kv, 0, tokens)
                if rep:
                    times.append(time.perf_counter() - t0)
                kv.free(0)
            rows.append(_row("ours", t, n, statistics.median(times)))
            bar.update()
    torch.set_num_threads(before)
    return rows


def llama_cpp(
    path: str, threads: Sequence[int], lengths: Sequence[int], repeats: int, bar: Any
) -> list[dict[str, Any]]:
    """llama-bench's prompt processing of each length on each thread count (its mean over repeats)."""
    from bench.lib.llama_tools import ensure_tools

    exe = ensure_tools()["llama-bench"]
    rows = []
    for t in threads:
        for n in lengths:
            cmd = [
                str(exe),
                "-m",
                path,
                "-p",
                str(n),
                "-n",
                "0",
                "-t",
                str(t),
                "-r",
                str(repeats),
                "-o",
                "json",
            ]
            done = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=1800)
            if done.returncode != 0:
                raise SystemExit(f"llama-bench failed ({done.returncode}): {done.stderr[-2000:]}")
            (result,) = [r for r in json.loads(done.stdout) if int(r.get("n_prompt", 0)) == n]
            rows.append(_row("llama.cpp", t, n, n / float(result["avg_ts"])))
            bar.update()
    return rows


def _row(system: str, threads: int, n: int, seconds: float) -> dict[str, Any]:
    return {
        "system": system,
        "threads": threads,
        "prompt_tokens": n,
        "ms": round(seconds * 1e3, 1),
        "tokens_per_s": round(n / seconds, 1),
    }


def run(args: argparse.Namespace) -> runner.Result:
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    bad = sorted(set(systems) - set(SYSTEMS))
    if bad or not systems:
        raise runner.UsageError(
            f"--systems: unknown {', '.join(bad) or 'empty'}; choose from {','.join(SYSTEMS)}"
        )
    if args.repeats < 1:
        raise runner.UsageError("--repeats must be at least 1")
    from shared.model_store import resolve

    path = str(resolve(args.model))
    total = len(systems) * len(args.threads) * len(args.lengths)
    rows: list[dict[str, Any]] = []
    with tqdm(total=total, desc="prefill", unit="cell", disable=args.no_progress) as bar:
        if "ours" in systems:
            rows += ours(args.model, args.threads, args.lengths, args.repeats, bar)
        if "llama.cpp" in systems:
            rows += llama_cpp(path, args.threads, args.lengths, args.repeats, bar)
    theirs = {
        (r["threads"], r["prompt_tokens"]): r["tokens_per_s"] for r in rows if r["system"] == "llama.cpp"
    }
    for r in rows:
        other = theirs.get((r["threads"], r["prompt_tokens"]))
        r["over_llama_cpp"] = round(r["tokens_per_s"] / other, 3) if other else None
    keys = ["system", "threads", "prompt_tokens", "ms", "tokens_per_s", "over_llama_cpp"]
    return runner.Result(rows, table([[r[k] for k in keys] for r in rows], keys))


def main(argv: Sequence[str] | None = None) -> int:
    return runner.main(__name__, argv)


if __name__ == "__main__":
    raise SystemExit(main())
