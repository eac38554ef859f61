"""Matrix products of the decoder's projections: plain torch, or oneDNN with pre-packed weights.

On CPU, `F.linear` goes through MKL's sgemm, which re-packs the weight matrix on every call; for the
skinny products of decoding (1 to ~64 rows) that repacking costs as much as the product itself, and
on AMD CPUs MKL also takes a slow generic path. Packing each weight once into oneDNN's blocked
layout (the same kernels torch.compile's CPU freezing uses) measured here on a Zen 4 core pair: a
decode step's projections 33 -> 19 ms, a 16-row tree 47 -> 24 ms, the 49,152-row LM head 8.9 ->
3.7 ms. The packed copy lives beside the original weights (which the embedding lookup, tests and
checkpoints keep using), so memory for the projections doubles on CPU.

`Gemm` hides the choice: `pack(weight)` once, then `linear(x, packed, bias)` per call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# oneDNN picks its blocked layout for an expected row count; 16 serves 1..300 rows within a few %
PACK_ROWS_HINT = 16
MIN_ROWS = 4  # products of fewer rows are padded (see Gemm.linear)
KINDS = ("auto", "onednn", "torch")


def onednn_available() -> bool:
    ops = torch.ops.mkldnn
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(ops, "_reorder_linear_weight")
        and hasattr(ops, "_linear_pointwise")
    )


def choose(kind: str, device: torch.device, dtype: torch.dtype) -> str:
    """Resolve "auto": oneDNN for float32 on CPU when torch has it, plain torch otherwise."""
    if kind not in KINDS:
        raise ValueError(f"gemm must be one of {KINDS}, got {kind!r}")
    if kind == "auto":
        return "onednn" if device.type == "cpu" and dtype == torch.float32 and onednn_available() else "torch"
    if kind == "onednn" and (device.type != "cpu" or not onednn_available()):
        raise ValueError("gemm 'onednn' needs a CPU device and a torch built with oneDNN")
    return kind


class Gemm:
    """y = x @ weight.T + bias with the weight prepared once."""

    def __init__(self, kind: str) -> None:
        self.kind = kind

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """weight: [out, in] -> an opaque prepared weight for `linear`."""
        if self.kind == "onednn":
            ops = torch.ops.mkldnn
            prepared: torch.Tensor = ops._reorder_linear_weight(weight.contiguous(), PACK_ROWS_HINT)
            return prepared
        return weight

    def linear(self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x: [rows, in] -> [rows, out]."""
        if self.kind == "onednn":
            rows = x.shape[0]
            if rows < MIN_ROWS:
                # Two reasons to pad: oneDNN's 1-row kernel sums in another order than its
                # many-row one (for inputs over ~1024 features), and its 1- and 2-row kernels are
                # slower than the 4-row one (~40 vs ~28 ms for a SmolLM2 step on one core). With
                # >= 2 rows every row is computed the same way whatever the row count, so a decode
                # step stays bit-identical to the same row inside a tree.
                padded = x.new_zeros(MIN_ROWS, x.shape[1])
                padded[:rows] = x
                y: torch.Tensor = torch.ops.mkldnn._linear_pointwise(padded, packed, bias, "none", [], "")
                return y[:rows]
            linear = torch.ops.mkldnn._linear_pointwise
            out: torch.Tensor = linear(x.contiguous(), packed, bias, "none", [], "")
            return out
        return F.linear(x, packed, bias)
