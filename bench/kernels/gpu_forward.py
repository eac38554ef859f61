"""ms per verify forward at N = 1..64 rows and decode tokens/s of a target of Qwen2.5-Coder-1.5B's
exact shape with random weights, on a GPU in bf16 (or a tiny shape on a CPU).

`python -m bench gpu_forward`: the weights are random (seeded, drawn on the device): the 1.5B's GGUF
(~1 GB) cannot travel to a machine with no network, and a forward's time does not depend on the
weights' values, only on their shapes and dtype (the JSON says so). N = 1 is a one-token decode
step; N > 1 is row 0 plus N - 1 nodes of a drafted-looking tree
(`bench.kernels.target_step.bench_tree`), after `--prefix` committed tokens, logits for every row,
each forward between two device synchronisations; medians of `--repeats`. decode_tok_s: one-token
steps with the argmax read back each step (what target-only decoding does). The goal checked: a
16-row verify forward <= 1.2x a one-token decode step.

On a CPU `--shape tiny` runs in seconds (the suite tests the arguments and the JSON with it).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the other benches, before torch loads

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

import numpy as np
import torch

from bench.harness import add_common_args
from bench.kernels.target_step import bench_tree
from bench.lib import runner
from bench.lib.device import sync, to_device
from bench.lib.runner import Result, UsageError
from shared.model import (
    LlamaModel,
    ModelConfig,
    build_model,
    decode_step,
    make_tiny_config,
    prefill_chunk,
    tree_round,
)
from shared.model.llama import ATTENTION_MODES
from shared.model.weights import resolve_device, resolve_dtype

# Qwen2.5-Coder-1.5B (shared/data/models.json; its GGUF metadata as config_from_gguf reads it)
QWEN_1_5B = ModelConfig(
    vocab_size=151936,
    hidden_size=1536,
    intermediate_size=8960,
    num_layers=28,
    num_heads=12,
    num_kv_heads=2,
    head_dim=128,
    rms_norm_eps=1e-6,
    rope_theta=1_000_000.0,
    tie_embeddings=False,
    qkv_bias=True,
    max_position=32768,
    architecture="qwen2",
)
SHAPES = {"qwen2.5-coder-1.5b": QWEN_1_5B, "tiny": make_tiny_config()}
WEIGHTS_NOTE = (
    "random weights (seeded, normal) of exactly this shape: the 1.5B's GGUF cannot travel to the GPU "
    "machine; a forward's time depends on the weights' shapes and dtype, not on their values"
)
GOAL_16_OVER_1 = 1.2
MAX_ROWS = 65  # the verifier's trees: row 0 + at most 64 nodes


def random_model(config: ModelConfig, dtype: torch.dtype, device: torch.device, seed: int) -> LlamaModel:
    """A model of `config`'s shape with seeded random weights drawn where they live (a 1.5B drawn
    on the host would take longer than the benchmark)."""
    model = build_model(config, None, dtype, device)
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in model.named_parameters():
        if p.dim() == 1 and "norm" in name:
            p.fill_(1.0)
        else:
            fan_in = p.shape[-1] if p.dim() > 1 else config.hidden_size
            std = 0.3 if name in ("embed", "lm_head") else fan_in**-0.5
            p.normal_(0.0, std, generator=gen)
    return model


def measure(
    model: LlamaModel, rows: Sequence[int], prefix: int, repeats: int, decode_tokens: int, seed: int
) -> dict[str, Any]:
    """forward_ms {N: median ms}, decode_tok_s, and the 16 / 1 ratio (when both N are measured)."""
    dev, vocab = model.device, model.config.vocab_size
    rng = np.random.default_rng(seed)
    kv = model.new_kv_cache(-(-(prefix + max(max(rows), decode_tokens) + 1) // 16) + 2, 16)
    kv.add(0)
    with torch.inference_mode():
        for a in range(0, prefix - 1, 512):  # the committed prefix, causal chunks
            part = rng.integers(3, vocab, min(512, prefix - 1 - a)).tolist()
            model.forward_packed([to_device(prefill_chunk(0, part, kv.cached_len(0)), dev)], kv)
            kv.commit_rows(0, range(len(part)))
        work = {
            n: to_device(
                tree_round(0, bench_tree(n - 1, prefix, vocab, seed), [int(rng.integers(3, vocab))]), dev
            )
            for n in rows
        }
        times: dict[int, list[float]] = {n: [] for n in rows}
        for rep in range(repeats + 1):  # the first pass warms up (kernel compiles, allocator)
            for n, x in work.items():
                sync(dev)
                t0 = time.perf_counter()
                model.forward_packed([x], kv)
                sync(dev)
                if rep:
                    times[n].append((time.perf_counter() - t0) * 1e3)
                kv.discard(0)
        forward = {str(n): round(statistics.median(times[n]), 3) for n in rows}
        tok = int(rng.integers(3, vocab))
        steps: list[float] = []
        lengths: list[int] = []
        for i in range(decode_tokens + 1):
            sync(dev)
            t0 = time.perf_counter()
            cached = kv.cached_len(0)
            (logits,) = model.forward_packed([to_device(decode_step(0, tok, cached), dev)], kv)
            kv.commit_rows(0, (0,))
            tok = int(logits[0].argmax())  # the read-back target-only decoding makes every token
            if i:  # the first step warms up
                steps.append(time.perf_counter() - t0)
                lengths.append(cached)
    out: dict[str, Any] = {
        "forward_ms": forward,
        "decode_tok_s": round(len(steps) / sum(steps), 2) if steps else None,
        "decode_step_ms_median": round(statistics.median(steps) * 1e3, 3) if steps else None,
        **decode_spread(steps, lengths),
    }
    if 1 in rows and 16 in rows:
        ratio = statistics.median(a / b for a, b in zip(times[16], times[1], strict=True))
        out["ratio_16_over_1"] = round(ratio, 3)
        out["goal_16_over_1"] = {"at_most": GOAL_16_OVER_1, "met": ratio <= GOAL_16_OVER_1}
    return out


def decode_spread(steps: Sequence[float], lengths: Sequence[int]) -> dict[str, Any]:
    """p90 and max of the decode steps (ms) and the steps over 3x the median as (cached length, ms):
    the mean (decode_tok_s) can sit far above the median when some steps stall (a kernel compiled
    for a new length, an allocation), and these say which."""
    if not steps:
        return {}
    med = statistics.median(steps)
    slow = [(n, round(t * 1e3, 2)) for t, n in zip(steps, lengths, strict=True) if t > 3 * med]
    return {
        "decode_step_ms_p90": round(float(np.percentile(steps, 90)) * 1e3, 3),
        "decode_step_ms_max": round(max(steps) * 1e3, 3),
        "decode_slow_steps": {"count": len(slow), "first": [list(x) for x in slow[:20]]},
    }


def ints(text: str) -> list[int]:
    try:
        out = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not out:
        raise argparse.ArgumentTypeError("expected at least one integer")
    return out


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shape", choices=list(SHAPES), default="qwen2.5-coder-1.5b", help="model shape")
    p.add_argument("--device", default="auto", help="auto (cuda when available), cuda[:N] or cpu")
    p.add_argument("--dtype", default="bf16", help="bf16, fp16 or fp32 (or bfloat16, float16, float32)")
    p.add_argument(
        "--attention",
        default="model",
        help=f"comma list of attention modes to measure, each one of {ATTENTION_MODES} ('model' on a "
        "GPU with Triton is the Triton kernel)",
    )
    p.add_argument("--rows", type=ints, default=[1, 2, 4, 8, 16, 32, 64], help=f"N rows, 1..{MAX_ROWS}")
    p.add_argument("--prefix", type=int, default=1024, help="committed tokens before each forward")
    p.add_argument("--repeats", type=int, default=10, help="timed forwards per N (median)")
    p.add_argument("--decode-tokens", type=int, default=64, help="one-token steps for decode tokens/s")
    add_common_args(
        p,
        json=True,
        json_help="rows: one per attention mode (also as by_attention); model_config: the shape",
        seed=0,
        seed_help="the weights and the trees",
    )


def check_args(args: argparse.Namespace) -> str | None:
    """The first bad argument, as an error message; None when all are good."""
    if any(not 1 <= n <= MAX_ROWS for n in args.rows):
        return f"--rows: each N must be in [1, {MAX_ROWS}], got {args.rows}"
    if args.prefix < 1:
        return f"--prefix must be >= 1, got {args.prefix}"
    if args.repeats < 1 or args.decode_tokens < 1:
        return "--repeats and --decode-tokens must be >= 1"
    bad = [m for m in args.attention.split(",") if m not in ATTENTION_MODES]
    if bad:
        return f"--attention: unknown mode(s) {bad}; choose from {ATTENTION_MODES}"
    try:
        resolve_dtype(args.dtype, torch.device("cpu"))
    except ValueError as exc:
        return f"--dtype: {exc}"
    if args.prefix + max(args.rows) + args.decode_tokens > SHAPES[args.shape].max_position:
        return "--prefix + max(--rows) + --decode-tokens exceeds the model's max_position"
    return None


def run(args: argparse.Namespace) -> Result:
    err = check_args(args)
    if err is not None:
        raise UsageError(err)
    device = resolve_device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda but torch sees no CUDA device")
    dtype = resolve_dtype(args.dtype, device)
    config = SHAPES[args.shape]
    model = random_model(config, dtype, device, args.seed)
    result: dict[str, Any] = {
        "shape": args.shape,
        "model_config": {k: v for k, v in asdict(config).items() if k != "rope_scaling"},
        "weights": WEIGHTS_NOTE,
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": str(dtype).removeprefix("torch."),
        "prefix": args.prefix,
        "repeats": args.repeats,
        "decode_tokens": args.decode_tokens,
        "torch": torch.__version__,
        "forward_rows": "N = rows of one forward: row 0 + (N - 1) tree nodes, logits for all",
        "by_attention": {},
    }
    lines = []
    for mode in args.attention.split(","):
        model.set_attention(mode)
        r = measure(model, args.rows, args.prefix, args.repeats, args.decode_tokens, args.seed)
        r["attention_kernel"] = model.attention_kernel
        result["by_attention"][mode] = r
        lines += summary_lines(mode, r)
    rows = [{"attention": mode, **r} for mode, r in result["by_attention"].items()]
    return Result(rows, "\n".join(lines), extra=result)


def summary_lines(mode: str, r: dict[str, Any]) -> list[str]:
    """The printed lines of one attention mode's figures."""
    kernel, fwd, dec = r["attention_kernel"], r["forward_ms"], r["decode_tok_s"]
    lines = [f"{mode} ({kernel}): forward ms {fwd}, decode {dec} tok/s"]
    if r.get("decode_slow_steps", {}).get("count"):
        lines.append(f"  decode steps over 3x the median (cached length, ms): {r['decode_slow_steps']}")
    if "ratio_16_over_1" in r:
        lines.append(f"  N=16 / N=1: {r['ratio_16_over_1']} (goal <= {GOAL_16_OVER_1})")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    return runner.main(__name__, argv)


if __name__ == "__main__":
    sys.exit(main())
