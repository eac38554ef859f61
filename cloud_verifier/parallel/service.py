"""The service with --tensor-parallel N: `serve_parallel` forms the group and runs the server on
rank 0 (the other ranks turn into workers), handing it `load_for_service` as its target loader.

The dependency goes one way: this module imports the server, the server knows nothing of
tensor parallelism (it calls the loader it is given).
"""

from __future__ import annotations

import os
import sys
from dataclasses import replace

import torch

from cloud_verifier.parallel.group import TPGroup, current
from cloud_verifier.parallel.launch import join, start, threads_per_rank, under_torchrun
from cloud_verifier.parallel.sharding import load_sharded_target
from cloud_verifier.parallel.worker import serve_commands
from cloud_verifier.server_config import ServerConfig
from shared.model.target import Target, resolve_weights


def load_for_service(config: ServerConfig) -> Target:
    """The server's loader with --tensor-parallel N: rank 0's shard, in the group `serve_parallel` made."""
    group = current()
    if group is None or group.rank != 0:
        raise RuntimeError("--tensor-parallel needs the ranks started first: run `cloud-verifier serve`")
    if group.world != config.tensor_parallel:
        raise RuntimeError(
            f"--tensor-parallel {config.tensor_parallel} but the group has {group.world} ranks"
        )
    return load_sharded_target(
        group, config.model, config.dtype, config.device, True, config.attention, config.weights
    )


def start_group(config: ServerConfig) -> tuple[ServerConfig, TPGroup]:
    """Rank 0 of a new group of `config.tensor_parallel` ranks on this machine (the others its
    child processes), and the config rank 0 serves with: the weights every rank loads ("auto"
    resolved once) and its share of the threads. ValueError for a device or GPU count the group
    cannot have."""
    if config.weights == "auto":
        config = replace(config, weights=resolve_weights(config.model, config.dtype, config.device))
    group = start(
        config.tensor_parallel,
        config.model,
        config.dtype,
        config.device,
        config.attention,
        config.threads,
        weights=config.weights,
    )
    return replace(config, threads=threads_per_rank(config.threads, config.tensor_parallel)), group


def serve_parallel(config: ServerConfig) -> int:
    """`cloud-verifier serve --tensor-parallel N` (or any serve under torchrun): rank 0 serves,
    the other ranks run `worker_loop`. Returns the process's exit status."""
    from cloud_verifier import logs, server  # (here: workers import this package, not the web stack)

    logs.setup(config.log_level, config.log_format)
    if config.weights == "auto":  # once, here: every rank must load the same weights
        config = replace(config, weights=resolve_weights(config.model, config.dtype, config.device))
    if under_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        if config.tensor_parallel not in (1, world):
            print(
                f"cloud-verifier: --tensor-parallel {config.tensor_parallel} but torchrun started {world} "
                "ranks; give --tensor-parallel WORLD_SIZE (or leave it out)",
                file=sys.stderr,
            )
            return 2
        config = replace(config, tensor_parallel=world)
        if config.threads:
            torch.set_num_threads(config.threads)
        try:
            group = join(config.device)
        except ValueError as exc:
            print(f"cloud-verifier: {exc}", file=sys.stderr)
            return 2
        if group.rank != 0:
            return serve_commands(
                group, config.model, config.dtype, config.device, config.attention, config.weights
            )
    else:
        try:
            config, group = start_group(config)
        except ValueError as exc:  # a device or a GPU count this group cannot have
            print(f"cloud-verifier: {exc}", file=sys.stderr)
            return 2
    try:
        return server.serve(config, loader=load_for_service)
    finally:
        group.close()
