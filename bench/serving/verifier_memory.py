"""The verifier's resident memory with a target loaded as the service loads it.

Loads the target (`--weights fp32`: dequantized, then packed with each float projection released,
as `cloud-verifier serve` does; `--weights quantized`: the GGUF's blocks, views of its memory map),
makes the KV pool the service would make (`kv_blocks_for` with the default ServerConfig), prefills
`--prefill` tokens and runs `--steps` decode steps, then reports the process's resident set now and
at its peak (/proc/self/statm, getrusage), the weights' bytes as the model runs them and the pool's.

    python -m bench verifier_memory --weights quantized
    python -m bench verifier_memory --weights fp32 --json out.json
"""

from __future__ import annotations

import argparse
import resource
import sys
from collections.abc import Sequence

import torch

from bench.harness import add_common_args, table
from bench.lib import runner
from bench.lib.args import add_model_args
from bench.lib.runner import Result, UsageError
from shared.model_store import DEFAULT_TARGET


def add_args(ap: argparse.ArgumentParser) -> None:
    add_model_args(
        ap,
        model=DEFAULT_TARGET,
        model_help="target alias or GGUF path",
        threads=2,
        threads_help="torch threads",
    )
    ap.add_argument(
        "--weights", default="quantized", choices=["fp32", "quantized"], help="how the target runs"
    )
    ap.add_argument("--prefill", type=int, default=300, help="prompt tokens prefilled into the pool")
    ap.add_argument("--steps", type=int, default=5, help="decode steps after the prefill")
    add_common_args(ap, json=True)


def rss_bytes() -> int:
    """This process's resident set now (Linux /proc/self/statm; 0 where there is none)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * resource.getpagesize()
    except (OSError, IndexError, ValueError):
        return 0


def measure(args: argparse.Namespace) -> dict[str, object]:
    from cloud_verifier.kv_pool import kv_blocks_for
    from cloud_verifier.server_config import ServerConfig
    from shared.model import decode_step, load_target, prefill

    torch.set_num_threads(args.threads)
    target = load_target(args.model, progress=False, weights=args.weights)
    if args.weights == "fp32":
        target.model.prepare(release=True)  # one copy of the weights, as the service holds them
    config = ServerConfig(model=args.model, weights=args.weights)
    blocks = kv_blocks_for(config, target)
    kv = target.new_kv_cache(blocks, config.block_size)
    kv.add(0)
    vocab = target.config.vocab_size
    prefill(target.model, kv, 0, [(17 * i) % vocab for i in range(args.prefill)])
    for i in range(args.steps):
        target.model.forward_packed([decode_step(0, 5, args.prefill + i)], kv)
        kv.commit_rows(0, [0])
    pool = sum(t.numel() * t.element_size() for t in (kv.k, kv.v, kv.kt) if t is not None)
    return {
        "model": target.model_id,
        "weights": target.model.weights,
        "weight_mib": round(target.model.weight_bytes() / 2**20, 1),
        "kv_blocks": blocks,
        "kv_pool_mib": round(pool / 2**20, 1),
        "rss_mib": round(rss_bytes() / 2**20, 1),
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }


def run(args: argparse.Namespace) -> Result:
    if args.prefill < 1 or args.steps < 0:
        raise UsageError("--prefill must be at least 1 and --steps at least 0")
    row = measure(args)
    return Result([row], table([list(row.values())], list(row)))


def main(argv: Sequence[str] | None = None) -> int:
    return runner.main(__name__, argv)


if __name__ == "__main__":
    sys.exit(main())
