"""ms per verify forward at tensor parallelism N against one process.

`python -m bench parallel`: the same total threads both ways: TP=1 is one process with `--threads`
threads; TP=N is N processes (rank 0 here, ranks 1.. started by cloud_verifier.parallel) with
threads/N each. A verify forward is row 0 plus N - 1 tree nodes after a committed prefix, logits for
every row (bench.kernels.target_step's measure_forward, so the figures compare with its cost curve).
The two configurations run one after the other (one model in memory at a time), not interleaved: a
machine whose load changes in between moves one column and not the other. `--device cuda`: TP=1 on
cuda:0 and TP=N over NCCL on cuda:0..N-1 (needs N GPUs), in `--dtype` (bf16 by default there).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads (see bench.kernels.target_step)

import argparse
import gc
import json
import platform
import sys
from collections.abc import Sequence
from typing import Any

import torch
from tqdm import tqdm

from bench.harness import add_common_args
from bench.kernels.target_step import measure_forward
from bench.lib import runner
from bench.lib.args import add_model_args
from bench.lib.runner import Result, UsageError
from cloud_verifier import parallel
from shared.model import Target, load_target


def _measure(
    target: Target, prefix: int, rows: list[int], repeats: int, label: str, progress: bool
) -> dict[str, float]:
    with tqdm(total=repeats * len(rows), desc=label, unit="run", disable=not progress) as bar:
        forward, _ = measure_forward(target, [prefix], rows, repeats, bar)
    return forward[str(prefix)]


def add_args(p: argparse.ArgumentParser) -> None:
    add_model_args(
        p,
        model="qwen2.5-coder-0.5b",
        model_help="target alias or path",
        threads=2,
        threads_help="threads in all (TP=1: all of them; TP=N: threads/N each)",
    )
    p.add_argument("--tensor-parallel", type=int, default=2, metavar="N", help="ranks of the parallel run")
    p.add_argument(
        "--rows", default="1,4,16,64", help="comma-separated rows per forward (row 0 + N - 1 nodes)"
    )
    p.add_argument("--prefix", type=int, default=128, help="committed tokens before the round")
    p.add_argument("--repeats", type=int, default=5, help="timed forwards per N (after one warm-up)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="cpu (gloo) or cuda (NCCL)")
    p.add_argument("--dtype", default="auto", help="auto (fp32 on CPU, bf16 on CUDA), fp32, bf16 or fp16")
    add_common_args(p, json=True, json_help="rows: one per N (without --json: printed)", no_progress=True)


def run(args: argparse.Namespace) -> Result:
    rows = [int(x) for x in args.rows.split(",") if x]
    if args.tensor_parallel < 2:
        raise UsageError("--tensor-parallel must be at least 2 (TP=1 is always measured)")
    try:  # (refused before anything loads: no CUDA, or fewer GPUs than ranks)
        parallel.select_device(args.device, 0, args.tensor_parallel, 0, spawning=True)
    except ValueError as exc:
        raise UsageError(str(exc)) from None

    torch.set_num_threads(args.threads)
    single = load_target(args.model, args.dtype, args.device, progress=False)
    tp1 = _measure(single, args.prefix, rows, args.repeats, "TP=1", not args.no_progress)
    del single
    gc.collect()

    if args.device == "cuda":
        torch.cuda.empty_cache()
    group = parallel.start(args.tensor_parallel, args.model, args.dtype, args.device, threads=args.threads)
    try:
        sharded = parallel.load_sharded_target(group, args.model, args.dtype, args.device, progress=False)
        tpn = _measure(
            sharded, args.prefix, rows, args.repeats, f"TP={args.tensor_parallel}", not args.no_progress
        )
    finally:
        group.close()

    share = parallel.threads_per_rank(args.threads, args.tensor_parallel)
    result: dict[str, Any] = {
        "model": args.model,
        "device": args.device,
        "dtype": str(sharded.model.dtype).removeprefix("torch."),
        "prefix": args.prefix,
        "repeats": args.repeats,
        "tp1": {"processes": 1, "threads": args.threads, "forward_ms": tp1},
        f"tp{args.tensor_parallel}": {
            "processes": args.tensor_parallel,
            "threads_each": share,
            "forward_ms": tpn,
        },
        "speedup": {n: round(tp1[n] / tpn[n], 3) for n in tp1},
        "machine": {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine()},
        "torch": torch.__version__,
    }
    lines = [f"{'N':>4} {'TP=1 ms':>10} {f'TP={args.tensor_parallel} ms':>10} {'TP=1/TP=N':>10}"]
    for n in tp1:
        lines.append(f"{n:>4} {tp1[n]:>10.2f} {tpn[n]:>10.2f} {result['speedup'][n]:>10.3f}")
    if args.json is None:  # no file: the whole result is printed under the table
        lines.append(json.dumps(result, indent=2))
    per_n = [
        {
            "n": int(n),
            "tp1_ms": tp1[n],
            f"tp{args.tensor_parallel}_ms": tpn[n],
            "speedup": result["speedup"][n],
        }
        for n in tp1
    ]
    return Result(per_n, "\n".join(lines), extra=result)


def main(argv: Sequence[str] | None = None) -> int:
    return runner.main(__name__, argv)


if __name__ == "__main__":
    sys.exit(main())
