"""The fused Triton tree-attention kernel against per-session SDPA with a dense mask (as the model's
_attend does) and the plain-torch reference, for every combination of --sessions, --nodes and
--prefix.

`python -m bench tree_attention`: for every (sessions, nodes, prefix): `sessions` tree sessions,
each with `prefix` committed positions and a verify round of row 0 + `nodes` nodes (a random
tree), K/V in a fragmented paged pool (every session's blocks shuffled through the pool). Three
ways to compute one layer's attention:

- triton: `treespec_kernels.tree_attention.tree_attention`, all sessions in one launch (check_values=False,
  as a model's per-layer call runs; the arguments are checked once beforehand);
- sdpa: what `LlamaModel._attend` does today, per session: gather the session's K/V through its
  slots (index_select), stack the GQA group's query heads along the rows, and
  F.scaled_dot_product_attention with a dense additive [group * n, prefix + n] mask; the masks are
  built before timing (the model builds them once per forward, not per layer), the gathers are timed;
- reference: `reference_tree_attention` (plain torch, float32; --no-reference skips it).

Medians of --repeats calls after --warmup, each call between two torch.cuda.synchronize() on CUDA.
The goal: triton >= 1.5x sdpa at 16 sessions x 64 nodes, prefix 8k, on an H200. On the CPU
the kernel runs in Triton's interpreter: tiny sizes only, to check the arguments and the JSON.
"""

from __future__ import annotations

import os

# Sleeping OpenMP waiters (as the other benches): spinning barriers stall on shared cores. Set
# before torch loads its OpenMP runtime; an explicit OMP_WAIT_POLICY wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import random
import sys
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from bench.harness import add_common_args
from bench.lib import runner
from bench.lib.runner import Result, UsageError
from bench.lib.stats import median_ms
from treespec_kernels.tree_attention import (
    ancestor_masks,
    reference_tree_attention,
    tree_attention,
    visibility,
)

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
MAX_NODES = 64
CPU_MAX_POSITIONS = 4096  # the interpreter runs a few thousand key positions a second


def ints(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not out:
        raise argparse.ArgumentTypeError("expected at least one integer")
    return out


def build_case(
    sessions: int, nodes: int, prefix: int, heads: int, kv_heads: int, head_dim: int, block_size: int,
    dtype: torch.dtype, device: torch.device, seed: int,
) -> dict[str, Any]:  # fmt: skip
    """Launch arguments of `tree_attention` for `sessions` tree sessions on a shuffled pool."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    n = nodes + 1
    per = -(-(prefix + n) // block_size)
    num_blocks = sessions * per
    order = torch.randperm(num_blocks, generator=g).to(torch.int32)
    tables = order.view(sessions, per).contiguous()
    slots = num_blocks * block_size
    k = torch.randn(kv_heads, slots, head_dim, generator=g).to(dtype)
    v = torch.randn(kv_heads, slots, head_dim, generator=g).to(dtype)
    masks = torch.cat([ancestor_masks([rng.randrange(i + 1) for i in range(nodes)]) for _ in range(sessions)])
    q = torch.randn(sessions * n, heads, head_dim, generator=g).to(dtype)
    return dict(
        q=q.to(device),
        k_cache=k.to(device),
        v_cache=v.to(device),
        block_tables=tables.to(device),
        row_starts=torch.arange(0, sessions * n + 1, n, dtype=torch.int32, device=device),
        cached_lens=torch.full((sessions,), prefix, dtype=torch.int32, device=device),
        tree_masks=masks.to(device),
        causal=torch.zeros(sessions, dtype=torch.bool, device=device),
        scale=head_dim**-0.5,
        block_size=block_size,
    )


def sdpa_attention(case: dict[str, Any]) -> Callable[[], torch.Tensor]:
    """The per-session SDPA path of `LlamaModel._attend` on this case, as a closure (masks and slot
    lists prepared outside it)."""
    q, k, v = case["q"], case["k_cache"], case["v_cache"]
    heads, kv_heads, hd = q.shape[1], k.shape[0], q.shape[2]
    group = heads // kv_heads
    bs = case["block_size"]
    rs, cached = case["row_starts"].tolist(), case["cached_lens"].tolist()
    parts = []
    for i, c in enumerate(cached):
        a, b = rs[i], rs[i + 1]
        n = b - a
        pos = torch.arange(c + n, device=q.device)
        slots = case["block_tables"][i].long()[pos // bs] * bs + pos % bs
        allowed = visibility(n, c, False, case["tree_masks"][a:b], q.device)
        mask = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill_(
            ~allowed, float("-inf")
        )
        parts.append((a, b, slots, mask.repeat(group, 1)))

    def run() -> torch.Tensor:
        outs = []
        for a, b, slots, mask in parts:
            n = b - a
            ks, vs = k.index_select(1, slots), v.index_select(1, slots)  # [kv_heads, L, hd]
            qg = q[a:b].reshape(n, kv_heads, group, hd).permute(1, 2, 0, 3).reshape(kv_heads, group * n, hd)
            o = F.scaled_dot_product_attention(qg[None], ks[None], vs[None], attn_mask=mask)[0]
            outs.append(o.reshape(kv_heads, group, n, hd).permute(2, 0, 1, 3).reshape(n, heads, hd))
        return torch.cat(outs)

    return run


def timed_ms(fn: Callable[[], torch.Tensor], device: torch.device, warmup: int, repeats: int) -> float:
    """The median ms of `fn` on `device`, synchronized around each call on CUDA."""
    cuda = device.type == "cuda"
    return median_ms(
        fn, repeats, warmup=warmup, sync=(lambda: torch.cuda.synchronize(device)) if cuda else None
    )


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cuda", help="cuda, or cpu (Triton's interpreter: tiny sizes only)")
    p.add_argument("--dtype", choices=list(DTYPES), default="bf16", help="q/K/V dtype")
    p.add_argument("--sessions", type=ints, default=[1, 4, 16], help="sessions per launch (comma list)")
    p.add_argument("--nodes", type=ints, default=[16, 64], help=f"tree nodes per session, 1..{MAX_NODES}")
    p.add_argument("--prefix", type=ints, default=[1024, 8192], help="committed positions per session")
    p.add_argument("--heads", type=int, default=12, help="query heads (12:2: Qwen2.5-Coder-1.5B)")
    p.add_argument("--kv-heads", type=int, default=2, help="KV heads (a divisor of --heads)")
    p.add_argument("--head-dim", type=int, default=128, help="head dimension (16..256, a power of two)")
    p.add_argument("--block-size", type=int, default=16, help="KV-cache block size in positions")
    p.add_argument("--repeats", type=int, default=20, help="timed calls per measurement (median)")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls first (the first compiles)")
    p.add_argument("--no-reference", action="store_true", help="skip the slow plain-torch reference")
    p.add_argument(
        "--block-m", type=int, default=None, help="kernel tile rows (query heads x rows); default tuned"
    )
    p.add_argument("--block-n", type=int, default=None, help="kernel key block; default tuned")
    p.add_argument("--num-warps", type=int, default=None, help="kernel warps; default tuned")
    p.add_argument("--num-stages", type=int, default=None, help="kernel pipeline stages; default tuned")
    add_common_args(
        p,
        json=True,
        json_help="rows: one per (sessions, nodes, prefix)",
        seed=0,
        seed_help="the trees, the pool layout and the data",
    )


def check_args(args: argparse.Namespace) -> torch.device:
    """The device the flags name, once every flag's value is checked (UsageError when one is wrong)."""
    if args.device not in ("cuda", "cpu") and not args.device.startswith("cuda:"):
        raise UsageError(f"--device must be cuda, cuda:N or cpu, got {args.device!r}")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(
            "--device cuda: CUDA is not available here; use --device cpu (interpreter, tiny sizes)"
        )
    if any(not 1 <= x <= MAX_NODES for x in args.nodes):
        raise UsageError(f"--nodes must be in 1..{MAX_NODES}, got {args.nodes}")
    if any(not 1 <= x <= 4096 for x in args.sessions):
        raise UsageError(f"--sessions must be in 1..4096, got {args.sessions}")
    if any(not 0 <= x <= 1 << 20 for x in args.prefix):
        raise UsageError(f"--prefix must be in 0..{1 << 20}, got {args.prefix}")
    if args.heads < 1 or args.kv_heads < 1 or args.heads % args.kv_heads:
        raise UsageError(f"--heads {args.heads} must be a positive multiple of --kv-heads {args.kv_heads}")
    if args.head_dim not in (16, 32, 64, 128, 256):
        raise UsageError(f"--head-dim must be a power of two in 16..256, got {args.head_dim}")
    if not 1 <= args.block_size <= 4096:
        raise UsageError(f"--block-size must be in 1..4096, got {args.block_size}")
    if args.repeats < 1 or args.warmup < 0:
        raise UsageError("--repeats must be >= 1 and --warmup >= 0")
    if device.type == "cpu":
        positions = max(args.sessions) * (max(args.prefix) + max(args.nodes) + 1)
        if positions > CPU_MAX_POSITIONS:
            raise UsageError(
                f"--device cpu runs Triton's interpreter: at most {CPU_MAX_POSITIONS} positions in a "
                f"launch (sessions x (prefix + nodes + 1) = {positions}); use smaller sizes or CUDA"
            )
    return device


def measure_case(
    args: argparse.Namespace, sessions: int, nodes: int, prefix: int, device: torch.device,
    tuning: dict[str, Any],
) -> dict[str, Any]:  # fmt: skip
    """One (sessions, nodes, prefix): the three ways' median ms and the kernel's distance to SDPA."""
    case = build_case(
        sessions, nodes, prefix, args.heads, args.kv_heads, args.head_dim, args.block_size,
        DTYPES[args.dtype], device, args.seed,
    )  # fmt: skip
    tree_attention(**case, **tuning)  # every argument checked once (and compiled)
    sdpa = sdpa_attention(case)
    diff = (tree_attention(**case, **tuning).float() - sdpa().float()).abs().max().item()
    fused = partial(tree_attention, **case, check_values=False, **tuning)
    triton_ms = timed_ms(fused, device, args.warmup, args.repeats)
    sdpa_ms = timed_ms(sdpa, device, args.warmup, args.repeats)
    ref_ms = None
    if not args.no_reference:
        reference = partial(reference_tree_attention, **case)
        ref_ms = timed_ms(reference, device, 0, max(1, args.repeats // 4))
    return {
        "sessions": sessions,
        "nodes": nodes,
        "prefix": prefix,
        "dtype": args.dtype,
        "triton_ms": round(triton_ms, 4),
        "sdpa_ms": round(sdpa_ms, 4),
        "reference_ms": None if ref_ms is None else round(ref_ms, 4),
        "speedup_vs_sdpa": round(sdpa_ms / triton_ms, 4),
        "max_abs_diff_vs_sdpa": diff,
    }


def table_line(row: dict[str, Any]) -> str:
    """One row of the printed table."""
    triton_ms, sdpa_ms, ref_ms = row["triton_ms"], row["sdpa_ms"], row["reference_ms"]
    ref_text = "-" if ref_ms is None else f"{ref_ms:.3f}"
    return (
        f"{row['sessions']:>8} {row['nodes']:>5} {row['prefix']:>6} {triton_ms:>10.3f} {sdpa_ms:>9.3f} "
        f"{ref_text:>9} {sdpa_ms / triton_ms:>7.2f}"
    )


def run(args: argparse.Namespace) -> Result:
    """The table is printed row by row as the cases finish (a GPU sweep takes minutes), so the
    Result's table is empty."""
    device = check_args(args)
    if device.type == "cpu" and "triton" not in sys.modules:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # the only way Triton runs on a CPU
    tuning = dict(
        block_m=args.block_m, block_n=args.block_n, num_warps=args.num_warps, num_stages=args.num_stages
    )
    rows: list[dict[str, Any]] = []
    names = ("sessions", "nodes", "prefix", "triton ms", "sdpa ms", "ref ms", "x sdpa")
    header = " ".join(f"{x:>{w}}" for x, w in zip(names, (8, 5, 6, 10, 9, 9, 7), strict=True))
    print(f"{args.heads}:{args.kv_heads} heads, head_dim {args.head_dim}, {args.dtype}, {device}")
    print(header, flush=True)
    for sessions in args.sessions:
        for nodes in args.nodes:
            for prefix in args.prefix:
                rows.append(measure_case(args, sessions, nodes, prefix, device, tuning))
                print(table_line(rows[-1]), flush=True)
    config = {
        **{k: v for k, v in vars(args).items() if k not in tuning},  # tuning: only what was set
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter)",
        "heads": args.heads,
        "kv_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "block_size": args.block_size,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "sdpa": "per session, dense additive mask, K/V gathered by slot (as LlamaModel._attend)",
        **{k: v for k, v in tuning.items() if v is not None},
    }
    return Result(rows, config=config)


def main(argv: Sequence[str] | None = None) -> int:
    return runner.main(__name__, argv)


if __name__ == "__main__":
    raise SystemExit(main())
