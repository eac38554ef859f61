"""Torch device helpers of the forward benches (bench.kernels.gpu_forward, bench.kernels.offload)."""

from __future__ import annotations

from typing import Any

import torch


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op off CUDA): a timer reads after this."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def to_device(x: Any, dev: torch.device) -> Any:
    """A forward's batch (seq_id, tokens, positions, tree_mask, logit_rows) on `dev`."""
    if dev.type == "cpu":
        return x
    mask = None if x.tree_mask is None else x.tree_mask.to(dev)
    return type(x)(x.seq_id, x.tokens.to(dev), x.positions.to(dev), mask, x.logit_rows.to(dev))
