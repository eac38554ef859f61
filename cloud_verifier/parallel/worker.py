"""Ranks > 0: `worker_loop` applies rank 0's commands to this rank's shard; `main` is the worker
process `start` launches (`python -m cloud_verifier.parallel`).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from cloud_verifier.parallel.group import TPGroup
from cloud_verifier.parallel.kv_cache import cache_digest, ranks_agree
from cloud_verifier.parallel.launch import join, under_torchrun
from cloud_verifier.parallel.protocol import Op, TensorParallelError, decode_inputs
from cloud_verifier.parallel.sharding import ShardedLlamaModel, load_worker_model, shard_model
from shared.model.kv_cache import PagedKVCache
from shared.model.llama import ATTENTION_MODES, GEMM_KINDS

log = logging.getLogger("cloud_verifier.parallel")


def worker_loop(group: TPGroup, model: ShardedLlamaModel) -> None:
    """Ranks > 0: apply rank 0's commands until STOP (or until the group breaks)."""
    caches: dict[int, PagedKVCache] = {}
    while True:
        op, cid, a, ints, data = group.receive()
        if op is Op.STOP:
            return
        try:
            if op is Op.NEW_CACHE:
                caches[cid] = model.new_kv_cache(a[0], a[1])
            elif op is Op.DROP_CACHE:
                caches.pop(cid, None)
            elif op is Op.SET_ATTENTION:
                model.set_attention(ATTENTION_MODES[a[0]])
            elif op is Op.SET_GEMM:
                model.set_gemm(GEMM_KINDS[a[0]])
            elif op is Op.CHECK_CACHE:
                kv = caches.get(cid)
                mine = cache_digest(kv) if kv is not None else None
                if mine != ints.tolist():
                    log.error("rank %d: KV cache %d differs from rank 0's", group.rank, cid)
                ranks_agree(group, mine == ints.tolist())
            else:
                kv = caches[cid]
                if op is Op.FORWARD:
                    model.forward_packed(decode_inputs(ints, data), kv)
                elif op is Op.ADD:
                    kv.add(a[0])
                elif op is Op.FREE:
                    kv.free(a[0])
                elif op is Op.DISCARD:
                    kv.discard(a[0])
                elif op is Op.TRUNCATE:
                    kv.truncate(a[0], a[1])
                elif op is Op.COMMIT_ROWS:
                    kv.commit_rows(a[0], ints.tolist())
        except TensorParallelError:
            raise
        except Exception as exc:  # rank 0 made the same call on the same state and got the same error
            log.debug("rank %d: %s failed as on rank 0: %s", group.rank, op.name, exc)


def run_worker(
    model: str, dtype: str, device: str, attention: str, threads: int, weights: str = "fp32"
) -> int:
    """A worker process: join, load this rank's shard, pack it, serve commands. Exit status 0
    after STOP, 1 when the group broke."""
    if threads:
        torch.set_num_threads(threads)
    return serve_commands(join(device), model, dtype, device, attention, weights)


def serve_commands(
    group: TPGroup, model: str, dtype: str, device: str, attention: str, weights: str = "fp32"
) -> int:
    """A worker rank of `group`: load, split and pack this rank's shard, then `worker_loop`. Exit
    status 0 after STOP, 1 when the group broke or the shard cannot be made."""
    try:
        sharded = shard_model(
            load_worker_model(model, dtype, str(group.device), attention, weights), group, model
        )
        sharded.prepare(release=True)
        worker_loop(group, sharded)
    except Exception as exc:  # a broken group, or a model this rank cannot load or split
        log.error("tensor-parallel rank %d stops: %s", group.rank, exc)
        return 1
    group.closing = True
    dist.destroy_process_group()
    return 0


@dataclass(frozen=True)
class _WorkerArgs:
    model: str
    dtype: str
    device: str
    attention: str
    threads: int
    weights: str


def _parse(argv: Sequence[str] | None) -> _WorkerArgs:
    p = argparse.ArgumentParser(
        prog="python -m cloud_verifier.parallel",
        description="One tensor-parallel worker rank of `cloud-verifier serve --tensor-parallel N` "
        "(started by it; reads RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT from the environment).",
    )
    p.add_argument("--model", required=True, help="the target alias or path rank 0 serves")
    p.add_argument("--dtype", default="auto", help="as serve --dtype")
    p.add_argument("--device", default="auto", help="as serve --device")
    p.add_argument("--attention", default="model", choices=list(ATTENTION_MODES), help="as serve --attention")
    p.add_argument("--threads", type=int, default=0, help="torch threads of this rank (0: torch's default)")
    p.add_argument(
        "--weights",
        default="fp32",
        choices=["fp32", "quantized"],
        help="as serve --weights, resolved by rank 0 (every rank loads the same)",
    )
    ns = p.parse_args(argv)
    return _WorkerArgs(ns.model, ns.dtype, ns.device, ns.attention, ns.threads, ns.weights)


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    a = _parse(argv)
    if not under_torchrun():
        print(
            "python -m cloud_verifier.parallel: RANK, WORLD_SIZE and MASTER_ADDR must be set", file=sys.stderr
        )
        return 2
    return run_worker(a.model, a.dtype, a.device, a.attention, a.threads, a.weights)
