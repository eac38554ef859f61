"""Forming the group: `start` (rank 0 starting ranks 1..N-1 on this machine) and `join` (a
worker it started, or any rank under torchrun).

`cloud-verifier serve --tensor-parallel N` starts ranks 1..N-1 itself (`python -m
cloud_verifier.parallel`, rendezvous on a free loopback port, `--threads` split between ranks);
under `torchrun` (RANK, WORLD_SIZE, MASTER_ADDR set) every rank runs `serve` and ranks > 0 turn
into workers.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from cloud_verifier.parallel.devices import backend_for, local_rank, nccl_error_handling, select_device
from cloud_verifier.parallel.group import JOIN_TIMEOUT_S, TPGroup, current, set_current


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def threads_per_rank(threads: int, world: int) -> int:
    """A rank's share of --threads (0: of the machine's cores), at least one."""
    total = threads or os.cpu_count() or 1
    return max(1, total // world)


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def start(
    world: int,
    model: str,
    dtype: str = "auto",
    device: str = "auto",
    attention: str = "model",
    threads: int = 0,
    timeout_s: float = JOIN_TIMEOUT_S,
    weights: str = "fp32",
) -> TPGroup:
    """Rank 0 of a new group on this machine: start ranks 1..world-1 (`python -m
    cloud_verifier.parallel`) and rendezvous with them on a free loopback port. `weights`: what
    every rank loads ("fp32" or "quantized"; rank 0 loads the same through load_sharded_target)."""
    if current() is not None:
        raise RuntimeError("this process is already in a tensor-parallel group")
    if world < 2:
        raise ValueError(f"a tensor-parallel group needs at least 2 ranks, got {world}")
    dev = select_device(device, 0, world, 0, spawning=True)  # (refused before anything starts)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
        nccl_error_handling(0)
    port = _free_port()
    share = threads_per_rank(threads, world)
    procs = []
    for r in range(1, world):
        env = {
            **os.environ,
            "RANK": str(r),
            "LOCAL_RANK": str(r),
            "WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": str(share),
            "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE"),
        }
        cmd = [sys.executable, "-m", "cloud_verifier.parallel", "--model", model, "--dtype", dtype]
        cmd += ["--device", dev.type, "--attention", attention, "--threads", str(share), "--weights", weights]
        # a session of its own: a terminal's Ctrl-C reaches rank 0 only, which stops the workers
        procs.append(subprocess.Popen(cmd, env=env, start_new_session=True))
    try:
        _rendezvous(procs, port, world, timeout_s, dev)
        group = set_current(TPGroup(0, world, procs, dev))
    except Exception:
        for p in procs:
            p.kill()
            p.wait()
        raise
    torch.set_num_threads(share)
    return group


def _rendezvous(
    procs: Sequence[subprocess.Popen[bytes]], port: int, world: int, timeout_s: float, device: torch.device
) -> None:
    """Rank 0's init_process_group, given up as soon as a worker exits instead of joining (it
    runs in a thread so that rank 0 can watch the workers meanwhile)."""
    errors: list[BaseException] = []

    def init() -> None:
        try:
            dist.init_process_group(
                backend_for(device),
                init_method=f"tcp://127.0.0.1:{port}",
                rank=0,
                world_size=world,
                timeout=timedelta(seconds=timeout_s),
                device_id=device if device.type == "cuda" else None,
            )
        except BaseException as exc:  # handed to the caller's thread
            errors.append(exc)

    th = threading.Thread(target=init, name="tp-rendezvous", daemon=True)
    th.start()
    while th.is_alive():
        th.join(0.1)
        for r, p in enumerate(procs, start=1):
            if th.is_alive() and p.poll() is not None:
                raise RuntimeError(
                    f"tensor-parallel rank {r} exited with code {p.returncode} before joining the group "
                    "(its error is above)"
                )
    if errors:
        raise errors[0]


def join(device: str = "cpu", timeout_s: float = JOIN_TIMEOUT_S) -> TPGroup:
    """Join the group described by RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT (torchrun, or a
    worker started by `start`), on `select_device(device, ...)` with LOCAL_RANK's GPU."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dev = select_device(device, rank, world, local_rank(rank))
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
        nccl_error_handling(rank)
    dist.init_process_group(
        backend_for(dev),
        timeout=timedelta(seconds=timeout_s),
        device_id=dev if dev.type == "cuda" else None,
    )
    return set_current(TPGroup(dist.get_rank(), dist.get_world_size(), device=dev))
