"""Int8 weights for the ONNX draft graph, quantized at export a few rows at a time.

`export-onnx --int8` writes each projection weight W [out, in] (the torch layout) as symmetric
8-bit blocks along its input axis, the layout of onnxruntime's `com.microsoft.MatMulNBits` with
bits = 8:

    q      uint8   [out, in_blocks, block]   round(W / scale) + 128, in [1, 255]
    scales float32 [out, in_blocks]          max |W| over the block / 127

so W ~= (q - 128) * scale, each block of `block` input values with its own scale. The graph runs
it with accuracy_level 4: onnxruntime quantizes the activations per block too and multiplies in
int8 (VNNI where the CPU has it). The embedding uses the same tensors: a Gather of rows of q and
of scales, dequantized in the graph, so a tied head stores its int8 weights once.

Rows are quantized in chunks of `CHUNK_VALUES` floats, so quantizing the 151,936 x 896 head of
Qwen2.5-Coder-0.5B holds a few MB of temporaries besides its int8 result, never an fp32 copy.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

BLOCKS = (128, 64, 32, 16)  # MatMulNBits block sizes tried, largest first (powers of two >= 16)
CHUNK_VALUES = 1 << 22  # floats quantized per step (16 MB of fp32 temporaries)
ZERO = 128  # MatMulNBits' default zero point for 8 bits (no zero-point tensor is written)


def block_size(k: int) -> int:
    """The largest block in BLOCKS that divides k (no padding), else the largest (k is padded)."""
    return next((b for b in BLOCKS if k % b == 0), BLOCKS[0])


def quantize_rows(w: np.ndarray, block: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Blockwise symmetric 8-bit quantization of w [rows, k], a chunk of rows at a time.

    Yields (q uint8 [r, blocks, block], scales float32 [r, blocks]) for consecutive row chunks;
    k is zero-padded to blocks * block. An all-zero block gets scale 0 (and q = ZERO)."""
    if w.ndim != 2:
        raise ValueError(f"quantize_rows takes a matrix, got shape {w.shape}")
    rows, k = w.shape
    blocks = -(-k // block)
    step = max(1, CHUNK_VALUES // max(1, k))
    for r0 in range(0, rows, step):
        a = np.zeros((min(step, rows - r0), blocks * block), dtype=np.float32)
        a[:, :k] = w[r0 : r0 + step]
        a = a.reshape(len(a), blocks, block)
        scale = np.abs(a).max(axis=-1) / np.float32(127)  # [r, blocks]
        inv = np.divide(np.float32(1), scale, out=np.zeros_like(scale), where=scale > 0)
        a *= inv[..., None]
        np.rint(a, out=a)
        np.clip(a, -127, 127, out=a)
        a += ZERO
        yield a.astype(np.uint8), scale.astype(np.float32)


def dequantize(q: np.ndarray, scales: np.ndarray, k: int) -> np.ndarray:
    """The float32 matrix [rows, k] that (q, scales) stand for (the reference the tests use)."""
    w = (q.astype(np.float32) - ZERO) * scales[..., None]
    out: np.ndarray = w.reshape(len(q), -1)[:, :k]
    return out
