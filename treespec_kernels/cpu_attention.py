"""CPU kernels of the float32 target (csrc/cpu_attention.cpp), built on first use: the
batch-invariant tree attention, a one-pass RMSNorm, the pool's tiled-key writer and the rotary
embedding fused with the K/V store, with the plain-torch reference of the attention
(`reference_tree_attention`) that the tests compare it to.

Why it exists: with a GEMM-based attention (SDPA) a tree node's logits differ from decoding its
path token by token by up to a few 1e-4 on SmolLM2 (the sums over keys are blocked by the shapes
of the call), so "the same tokens as the target alone" would rest on luck at near-ties. This
kernel fixes every reduction's order by key position, and oneDNN's projections are already
row-invariant, so a node's logits are bit-identical to incremental decoding, in float32 and at
SDPA's speed. See the .cpp file for the scheme.

The extension is built on first use (treespec_kernels/cpp_build.py). When it cannot be built the
model falls back to SDPA and torch's RMSNorm and says so once; `TREESPEC_CPU_KERNELS=off` skips
them outright.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from treespec_kernels.cpp_build import CppExtension

SOURCE = Path(__file__).with_name("csrc") / "cpu_attention.cpp"
HEAD_DIMS = tuple(range(16, 129, 16))

# -fopenmp: at::parallel_for is an inline OpenMP loop, serial without it; the library it links,
# libgomp.so.1, resolves to the one torch has loaded already
_EXT = CppExtension(
    "treespec_cpu_attention",
    SOURCE.name,
    ["-O3", "-march=native", "-ffp-contract=fast", "-fno-math-errno", "-fopenmp"],
    "batch-invariant CPU attention falls back to SDPA",
)


def load() -> Any:
    """The compiled module, or None when it is disabled or cannot be built (reason: `error()`)."""
    mod = _EXT.module  # built already: no call (this runs for every layer of every forward)
    return mod if mod is not None else _EXT.load()


def error() -> str | None:
    return _EXT.error()


def _require() -> Any:
    mod = _EXT.module
    return mod if mod is not None else _EXT.require()


def supports(head_dim: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the kernel serves this model (float32 on CPU, head_dim a multiple of 16 up to 128)."""
    return device.type == "cpu" and dtype == torch.float32 and head_dim in HEAD_DIMS


def tree_attention(
    q: torch.Tensor,
    kt: torch.Tensor,
    v: torch.Tensor,
    slots: torch.Tensor,
    allowed: torch.Tensor,
    cached: int,
    scale: float,
) -> torch.Tensor:
    """q: [kv_heads, group * n, hd] (row g * n + i = new row i of query head g); kt: [kv_heads,
    pool slots // 16, hd, 16] (the keys transposed within 16-slot tiles) and v: [kv_heads, pool
    slots, hd], one layer of the pool; slots: [cached + n] int64, the pool slot of every position;
    allowed: [n, n] bool (new row i sees new row j). Returns [kv_heads, group * n, hd]. Raises
    RuntimeError when the kernels are not available."""
    out: torch.Tensor = _require().tree_attention(q, kt, v, slots, allowed, cached, scale)
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [rows, hidden] float32 -> RMSNorm(x) * weight in one pass per row (row-invariant).
    Raises RuntimeError when the kernel is not available."""
    out: torch.Tensor = _require().rms_norm(x.contiguous(), weight, eps)
    return out


def rope_store(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin_signed: torch.Tensor,
    slots: torch.Tensor,
    pool: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    heads: int,
) -> torch.Tensor:
    """One layer's rotary embedding and K/V store in one pass. qkv: [T, (heads + 2 kv_heads) hd]
    float32 (queries, keys, values); cos, sin_signed: [T, hd] (the first half of sin negated);
    slots: [T] int64; pool: the layer's (k, v, kt), [kv_heads, slots, hd] twice and the tiled keys
    [kv_heads, slots / 16, hd, 16]. Returns the rotated queries [T, heads, hd]; the keys (rotated)
    and values are stored at `slots`. Bit-identical to Rotary.apply followed by PagedKVCache.write.
    Raises RuntimeError when the kernel is not available or a shape is wrong."""
    k, v, kt = pool
    out: torch.Tensor = _require().rope_store(qkv, cos, sin_signed, slots, k, v, kt, heads)
    return out


def reference_tree_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slots: torch.Tensor,
    allowed: torch.Tensor,
    cached: int,
    scale: float,
) -> torch.Tensor:
    """What `tree_attention` computes, in plain torch (SDPA with the mask; equal to float32 rounding,
    not bit-identical). q: [kv_heads, group * n, hd]; k, v: [kv_heads, pool slots, hd] (keys not
    tiled); slots: [cached + n] int64; allowed: [n, n] bool. Returns [kv_heads, group * n, hd]."""
    n = allowed.shape[0]
    group = q.shape[1] // n
    seen = torch.ones(n, cached, dtype=torch.bool, device=allowed.device)
    mask = torch.cat((seen, allowed), dim=1).repeat(group, 1)
    out = F.scaled_dot_product_attention(
        q[None], k[None][:, :, slots], v[None][:, :, slots], attn_mask=mask, scale=scale
    )
    return out[0]
