"""The device and collective backend of a tensor-parallel rank.

On CPU every rank uses gloo; with --device cuda (or auto where CUDA is available) every rank uses
NCCL on `cuda:{LOCAL_RANK}` (the workers `serve` starts get LOCAL_RANK = RANK; torchrun sets it),
and every tensor of a collective lives there: the command buffers, the all-reduced [T, hidden]
partial sums, the logit shards and the cache-check flag. Starting N workers on CUDA needs N
visible GPUs (refused otherwise, with torch.cuda.device_count()).
"""

from __future__ import annotations

import os

import torch

from shared.model.weights import resolve_device

CPU = torch.device("cpu")


def backend_for(device: torch.device) -> str:
    """The collective backend of a rank on `device`: NCCL on CUDA, gloo on the CPU."""
    return "nccl" if device.type == "cuda" else "gloo"


def local_rank(rank: int) -> int:
    """This process's GPU index among the ranks on its machine: LOCAL_RANK (torchrun, or `start`)."""
    raw = os.environ.get("LOCAL_RANK", str(rank))
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"LOCAL_RANK must be an integer, got {raw!r}") from None


def select_device(device: str, rank: int, world: int, local: int, spawning: bool = False) -> torch.device:
    """The device of rank `rank` of `world` for --device `device` (auto: CUDA when available):
    the CPU, or `cuda:{local}` (one GPU a rank). `spawning`: this process is about to start all
    `world` ranks on this machine, so `world` GPUs must be visible."""
    dev = resolve_device(device)
    if dev.type == "cpu":
        return CPU
    if dev.type != "cuda":
        raise ValueError(f"tensor parallelism runs on CPUs (gloo) or CUDA GPUs (NCCL), not --device {device}")
    if dev.index is not None:
        raise ValueError(
            f"--device {device} with --tensor-parallel: give --device cuda; rank r uses cuda:LOCAL_RANK "
            "(restrict the GPUs with CUDA_VISIBLE_DEVICES)"
        )
    if not torch.cuda.is_available():
        raise ValueError("--device cuda: CUDA is not available here; use --device cpu")
    count = torch.cuda.device_count()
    if spawning and count < world:
        raise ValueError(
            f"--tensor-parallel {world} on CUDA needs {world} GPUs (one a rank), but "
            f"torch.cuda.device_count() is {count}; use --tensor-parallel {count} or fewer, or --device cpu"
        )
    if not 0 <= local < count:
        raise ValueError(
            f"tensor-parallel rank {rank} needs GPU cuda:{local} (its LOCAL_RANK), but "
            f"torch.cuda.device_count() is {count}"
        )
    return torch.device("cuda", local)


def nccl_error_handling(rank: int) -> None:
    """Rank 0 keeps its process when a collective fails (abort the communicators, raise): the
    service answers 503. Workers keep torch's default (tear the process down)."""
    if rank == 0:
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
