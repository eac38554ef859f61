"""Tensor parallelism of the target (Megatron-LM's layout) over torch.distributed: gloo on CPUs,
NCCL on CUDA GPUs (one GPU a rank).

Layout, for N ranks, rank r (GQA groups stay whole on a rank, so attention needs no communication):
  * q heads [r H/N, (r+1) H/N) and KV heads [r KV/N, (r+1) KV/N): the matching rows of the fused
    qkv weight and bias (column-parallel q/k/v), the matching columns of o (row-parallel);
  * gate and up rows [r I/N, (r+1) I/N), kept fused as [gate_r | up_r] (column-parallel), the
    matching columns of down (row-parallel);
  * one all-reduce (sum) of the [T, hidden] partial output after o and one after down per layer
    (the `all_reduce` hook of LlamaModel); norms, embeddings and rotary tables are replicated;
  * the head is VOCAB-PARALLEL: rank r computes the logits of vocabulary rows [r V/N, (r+1) V/N)
    and they are gathered to rank 0 (the only rank that needs them). Why not a head replicated on
    rank 0: the head is the largest single matrix of a small model (Qwen2.5-0.5B: 136M of its
    494M parameters, 15-40% of a verify forward), so on rank 0 alone it would leave the other
    ranks idle for that share of every step and hold its packed copy (0.54 GB fp32) on rank 0
    only; sharded, every rank does 1/N of it and packs 1/N of it, for one gather of
    [rows, V/N] float32 per rank (1.2 MB a rank at 4 rows: far cheaper than the matmul it splits);
  * each rank keeps its own PagedKVCache holding its KV heads, with the SAME block tables.


Rank 0 runs the service and the engine; its model (`ShardedLlamaModel`) and KV cache
(`ShardedKVCache`) send each forward and each KV-cache change to the other ranks as a compact
int64/uint8 command (no pickle) before doing the same locally, and ranks > 0 run `worker_loop`,
which applies each command to their shard. (None of this has run on GPUs yet: see
tests/cloud_verifier/test_parallel_cuda.py.)

The modules, each importing only those above it:
  * devices   the rank's device and backend (gloo on CPUs, NCCL on `cuda:{LOCAL_RANK}`);
  * protocol  the commands: header, payload, a forward's inputs as int64 words and mask bytes;
  * group     `TPGroup`: the command channel, a forward's collectives, liveness; `current()`;
  * launch    `start` (rank 0 starts ranks 1..N-1 here) and `join` (a worker, or torchrun);
  * kv_cache  `ShardedKVCache`: rank 0's cache, each mutation sent to every rank in one order;
  * sharding  `shard_model`, `ShardedLlamaModel`, `load_sharded_target`;
  * worker    `worker_loop` and the worker process (`python -m cloud_verifier.parallel`);
  * service   `serve_parallel`: the server on rank 0, given `load_for_service` as its loader.
"""

from cloud_verifier.parallel.devices import CPU, backend_for, local_rank, select_device
from cloud_verifier.parallel.group import IDLE_TIMEOUT, JOIN_TIMEOUT_S, STEP_TIMEOUT_S, TPGroup, current
from cloud_verifier.parallel.kv_cache import ShardedKVCache, cache_digest
from cloud_verifier.parallel.launch import join, start, threads_per_rank, under_torchrun
from cloud_verifier.parallel.protocol import (
    HEADER,
    MAX_BYTES,
    MAX_INTS,
    Op,
    TensorParallelError,
    decode_inputs,
    encode_inputs,
    pack_command,
    payload_size,
    unpack_payload,
)
from cloud_verifier.parallel.service import load_for_service, serve_parallel
from cloud_verifier.parallel.sharding import (
    ShardedLlamaModel,
    check_shardable,
    load_sharded_target,
    shard_model,
)
from cloud_verifier.parallel.worker import main, run_worker, worker_loop

__all__ = [
    "CPU",
    "HEADER",
    "IDLE_TIMEOUT",
    "JOIN_TIMEOUT_S",
    "MAX_BYTES",
    "MAX_INTS",
    "STEP_TIMEOUT_S",
    "Op",
    "ShardedKVCache",
    "ShardedLlamaModel",
    "TPGroup",
    "TensorParallelError",
    "backend_for",
    "cache_digest",
    "check_shardable",
    "current",
    "decode_inputs",
    "encode_inputs",
    "join",
    "load_for_service",
    "load_sharded_target",
    "local_rank",
    "main",
    "pack_command",
    "payload_size",
    "run_worker",
    "select_device",
    "serve_parallel",
    "shard_model",
    "start",
    "threads_per_rank",
    "under_torchrun",
    "unpack_payload",
    "worker_loop",
]
