"""Milliseconds per draft-training step, float32 against bf16 autocast (`draft-training distill
--autocast`), on this CPU: forward, loss and backward of a draft, alternating step by step; the median of
--steps each.

One step is what `distill` does per record: the student's forward over a sequence of --seq tokens,
the KL + 0.1 CE loss on its last --positions positions against a made-up teacher distribution, and
the backward (the optimizer's step is left out: it is the same in both and small). Full fine-tuning
of the draft's blocks, or LoRA (--lora-rank). The two variants alternate, step by step, after a
warm-up of each, so that a drift of the machine falls on both; the median of --steps each is kept.

    python -m bench train_step --draft smollm2-135m-q4-l8 --json out.json
    python -m bench train_step --draft qwen2.5-coder-0.5b-q4 --lora-rank 16 --json out.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch
from tqdm import tqdm

from bench.harness import add_common_args, table
from bench.lib import runner
from bench.lib.args import add_model_args
from bench.lib.runner import Result, UsageError

VARIANTS = ("none", "bf16")


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return "unknown"
    return ",".join(x for x in ("avx512_bf16", "amx_bf16", "amx_tile") if x in flags) or "none of bf16's"


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--draft",
        default="smollm2-135m-q4-l8",
        help="the draft to train: alias, GGUF path or tiny (a test model)",
    )
    ap.add_argument("--lora-rank", type=int, default=0, help="LoRA rank on every projection (0: full blocks)")
    ap.add_argument("--seq", type=int, default=160, help="tokens of one record (prompt + continuation)")
    ap.add_argument("--positions", type=int, default=64, help="positions the loss reads (the continuation)")
    ap.add_argument("--steps", type=int, default=6, help="timed steps of each variant (after one warm-up)")
    add_model_args(ap, threads=0)
    add_common_args(ap, json=True, json_help="rows: ms per step per variant", no_progress=True)


def run(a: argparse.Namespace) -> Result:
    if a.steps < 1 or a.seq < 2 or not 1 <= a.positions < a.seq or a.lora_rank < 0:
        raise UsageError("--steps >= 1, --seq >= 2, 1 <= --positions < --seq and --lora-rank >= 0")
    if a.threads:
        torch.set_num_threads(a.threads)
    rows = measure(a)
    text = table([[r["variant"], r["ms_per_step"], r["tokens_per_s"], r["speedup"]] for r in rows],
                 ["autocast", "ms / step", "tokens / s", "x float32"])  # fmt: skip
    return Result(rows, text, extra={"cpu_bf16": _cpu_flags(), "threads": torch.get_num_threads()})


def measure(a: argparse.Namespace) -> list[dict[str, Any]]:
    """Both variants' rows: ms per step (the median), tokens per second, the speed-up over float32."""
    from draft_training.distill import DistillConfig, Example, example_loss
    from draft_training.student import Student, TrainSpec
    from edge_client.models import resolve_draft
    from shared.model import load_target

    path = "tiny" if a.draft == "tiny" else str(resolve_draft(a.draft, progress=not a.no_progress))
    model = load_target(path, progress=not a.no_progress).model
    spec = TrainSpec(lora_rank=a.lora_rank) if a.lora_rank else TrainSpec()
    student = Student(model, spec)
    gen = torch.Generator().manual_seed(0)
    vocab, n, k = model.config.vocab_size, a.positions, 32
    top = torch.rand(n, k, generator=gen)
    ids = torch.randint(0, vocab, (a.seq + n + n * k,), generator=gen)
    ex = Example(
        ids[: a.seq], a.seq - n, ids[a.seq : a.seq + n], ids[a.seq + n :].view(n, k),
        0.9 * top / top.sum(-1, keepdim=True), torch.full((n,), 0.1),
    )  # fmt: skip
    configs = {v: DistillConfig(a.draft, autocast=v) for v in VARIANTS}
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    bar = tqdm(
        total=(a.steps + 1) * len(VARIANTS), desc="train steps", file=sys.stderr, disable=a.no_progress
    )
    for i in range(a.steps + 1):
        for v in VARIANTS:
            student.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            example_loss(student, ex, configs[v]).backward()
            if i:  # the first of each is a warm-up
                times[v].append((time.perf_counter() - t0) * 1e3)
            bar.update()
    bar.close()
    base = statistics.median(times["none"])
    rows = []
    for v in VARIANTS:
        ms = statistics.median(times[v])
        rows.append({
            "variant": v, "ms_per_step": round(ms, 1), "tokens_per_s": round(a.seq / ms * 1e3, 1),
            "speedup": round(base / ms, 3), "ms_each": [round(t, 1) for t in times[v]],
            "draft": a.draft, "lora_rank": a.lora_rank, "seq": a.seq, "positions": n,
        })  # fmt: skip
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    return runner.main(__name__, argv)


if __name__ == "__main__":
    sys.exit(main())
