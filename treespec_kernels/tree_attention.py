"""Tree attention over the paged KV cache for a packed verify forward: one fused Triton kernel for
every session's rows, its typed launcher, and the plain-torch reference that CPU CI tests it against.

What a row sees (docs/architecture.md §3.1): session s owns the packed rows row_starts[s]:row_starts[s+1];
its new row i sits at position cached + i, and sees every cached position (< cached) and new row j iff
  - causal session (prefill chunk, single step, any n): j <= i;
  - tree session (row 0 = the last committed token, rows 1..n-1 = up to 64 tree nodes): j == 0, j == i,
    or bit j-1 of the row's int64 mask (`ancestor_masks` builds it from a parent array).
Query head h reads KV head h // (num_heads // num_kv_heads). Sums and the softmax run in float32; the
output has q's dtype. The new rows' K/V must already be in the cache (as `forward_packed` writes them).

Triton is imported on first launch, so this module loads where it is missing. CUDA tensors run the
compiled kernel; CPU tensors run in Triton's numpy interpreter (tests; slow), which needs
TRITON_INTERPRET=1 before Triton is imported: the first launch sets it when there is no CUDA and
nothing has imported Triton yet; with CUDA present it is never forced (set it yourself to interpret).
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

import torch

MAX_TREE_ROWS = 65  # row 0 + 64 nodes: one int64 mask bit per node
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
HEAD_DIMS = (16, 32, 64, 128, 256)


def ancestor_masks(parents: Sequence[int]) -> torch.Tensor:
    """The [n] int64 visibility masks of a tree session's rows from the parents of nodes 1..n-1.

    parents[k] is the row of node k+1's parent (0 = row 0, the root; otherwise an earlier node, so
    parents[k] <= k). Bit j-1 of row i's mask is set for every node j on the path root -> i, i itself
    included; row 0's mask is 0. (shared/tree.py's TokenTree parents, -1 for a child of row 0 and node
    indices from 0, are `[p + 1 for p in tree.parents]`.) Bit 63 (node 64) is int64's sign bit.
    """
    n = len(parents) + 1
    if n > MAX_TREE_ROWS:
        raise ValueError(f"parents: at most {MAX_TREE_ROWS - 1} nodes, got {n - 1}")
    masks = [0] * n
    for k, p in enumerate(parents):
        row = k + 1
        if not isinstance(p, int) or isinstance(p, bool) or not 0 <= p < row:
            raise ValueError(f"parents[{k}] (node {row}) must be an int in [0, {row}), got {p!r}")
        masks[row] = masks[p] | (1 << (row - 1))
    signed = [m - (1 << 64) if m >= 1 << 63 else m for m in masks]
    return torch.tensor(signed, dtype=torch.int64)


def _fail(arg: str, what: str) -> NoReturn:
    raise ValueError(f"tree_attention: {arg} {what}")


def _check_index(arg: str, x: Any, dtype: torch.dtype, shape: tuple[int, ...], device: torch.device) -> None:
    if not isinstance(x, torch.Tensor):
        _fail(arg, f"must be a tensor, got {type(x).__name__}")
    if x.dtype != dtype:
        _fail(arg, f"must be {dtype}, got {x.dtype} (convert it with .to({dtype}))")
    if tuple(x.shape) != shape:
        _fail(arg, f"must have shape {list(shape)}, got {list(x.shape)}")
    if x.device != device:
        _fail(arg, f"is on {x.device}, q on {device}: all tensors must be on one device")


def _check(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    row_starts: torch.Tensor,
    cached_lens: torch.Tensor,
    tree_masks: torch.Tensor | None,
    causal: torch.Tensor | None,
    scale: float,
    block_size: int,
    check_values: bool,
) -> None:
    """Shapes, dtypes, layout and devices always; with check_values also the index values (a device
    sync on a GPU)."""
    _check_qkv(q, k_cache, v_cache, scale, block_size)
    _check_indexes(q, block_tables, row_starts, cached_lens, tree_masks, causal)
    if check_values:
        t, num_slots = q.shape[0], k_cache.shape[1]
        _check_index_values(
            t, num_slots, block_tables, row_starts, cached_lens, tree_masks, causal, block_size
        )


def _check_qkv(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float, block_size: int
) -> None:
    """q and the KV cache: tensors of a supported dtype and head_dim, contiguous in head_dim, on one
    device, with whole groups of query heads per KV head; block_size and scale."""
    for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(x, torch.Tensor):
            _fail(name, f"must be a tensor, got {type(x).__name__}")
        if x.dim() != 3:
            _fail(name, f"must be 3-D, got shape {list(x.shape)}")
        if x.dtype not in DTYPES:
            _fail(name, f"must be float16, bfloat16 or float32, got {x.dtype}")
        if x.stride(2) != 1:
            _fail(name, "must be contiguous in head_dim (stride 1 in the last dimension)")
    _, heads, head_dim = q.shape
    device = q.device
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        _fail(
            "k_cache", f"and v_cache must have q's dtype {q.dtype}, got {k_cache.dtype} and {v_cache.dtype}"
        )
    if v_cache.shape != k_cache.shape:
        _fail("v_cache", f"must have k_cache's shape {list(k_cache.shape)}, got {list(v_cache.shape)}")
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
        if x.device != device:
            _fail(name, f"is on {x.device}, q on {device}: all tensors must be on one device")
    kv_heads, num_slots, kd = k_cache.shape
    if kd != head_dim:
        _fail("k_cache", f"head_dim {kd} differs from q's {head_dim}")
    if head_dim not in HEAD_DIMS:
        _fail("q", f"head_dim must be one of {HEAD_DIMS}, got {head_dim}")
    if kv_heads == 0 or heads % kv_heads:
        _fail("q", f"num_heads {heads} must be a multiple of k_cache's num_kv_heads {kv_heads}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        _fail("block_size", f"must be a positive int, got {block_size!r}")
    if num_slots % block_size:
        _fail("k_cache", f"num_slots {num_slots} is not a multiple of block_size {block_size}")
    if not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        _fail("scale", f"must be a finite positive number, got {scale!r}")


def _check_indexes(
    q: torch.Tensor,
    block_tables: torch.Tensor,
    row_starts: torch.Tensor,
    cached_lens: torch.Tensor,
    tree_masks: torch.Tensor | None,
    causal: torch.Tensor | None,
) -> None:
    """The index tensors' dtypes, shapes (S from row_starts, T from q), devices and layout."""
    t, device = q.shape[0], q.device
    if not isinstance(row_starts, torch.Tensor) or row_starts.dim() != 1 or row_starts.numel() < 1:
        _fail("row_starts", "must be a 1-D tensor of S + 1 int32 row offsets")
    s = row_starts.numel() - 1
    _check_index("row_starts", row_starts, torch.int32, (s + 1,), device)
    _check_index("cached_lens", cached_lens, torch.int32, (s,), device)
    if not isinstance(block_tables, torch.Tensor) or block_tables.dim() != 2:
        _fail("block_tables", "must be a 2-D [S, max_blocks] int32 tensor")
    _check_index("block_tables", block_tables, torch.int32, (s, block_tables.shape[1]), device)
    if tree_masks is not None:
        _check_index("tree_masks", tree_masks, torch.int64, (t,), device)
    if causal is not None:
        _check_index("causal", causal, torch.bool, (s,), device)
    indexes: dict[str, torch.Tensor | None] = {
        "row_starts": row_starts,
        "cached_lens": cached_lens,
        "tree_masks": tree_masks,
        "causal": causal,
    }
    for name, ix in indexes.items():
        if ix is not None and not ix.is_contiguous():
            _fail(name, "must be contiguous")
    if block_tables.stride(1) != 1:
        _fail("block_tables", "must be contiguous along max_blocks")


def _check_index_values(
    t: int,
    num_slots: int,
    block_tables: torch.Tensor,
    row_starts: torch.Tensor,
    cached_lens: torch.Tensor,
    tree_masks: torch.Tensor | None,
    causal: torch.Tensor | None,
    block_size: int,
) -> None:
    """The index values (read back to the host): row_starts from 0 to T, never decreasing; cached
    lengths >= 0; tree sessions with masks and at most MAX_TREE_ROWS rows; each session's block
    table long enough for its positions, with ids inside the pool of num_slots // block_size."""
    s = row_starts.numel() - 1
    rs = row_starts.tolist()
    cached = cached_lens.tolist()
    kinds = [True] * s if causal is None else causal.tolist()
    if rs[0] != 0 or rs[-1] != t:
        _fail("row_starts", f"must start at 0 and end at T = {t}, got {rs[0]} and {rs[-1]}")
    max_blocks, num_blocks = block_tables.shape[1], num_slots // block_size
    for i in range(s):
        n, c = rs[i + 1] - rs[i], cached[i]
        if n < 0:
            _fail("row_starts", f"must not decrease (session {i}: {rs[i]} -> {rs[i + 1]})")
        if c < 0:
            _fail("cached_lens", f"must be >= 0 (session {i}: {c})")
        if not kinds[i]:
            if tree_masks is None:
                _fail("tree_masks", f"is None but session {i} is a tree session (causal[{i}] is False)")
            if n > MAX_TREE_ROWS:
                _fail("row_starts", f"session {i} is a tree session of {n} rows; at most {MAX_TREE_ROWS}")
        need = -(-(c + n) // block_size)
        if need > max_blocks:
            _fail("block_tables", f"session {i} needs {need} blocks for {c + n} positions, has {max_blocks}")
        if need:
            used = block_tables[i, :need]
            lo, hi = int(used.min()), int(used.max())
            if lo < 0 or hi >= num_blocks:
                _fail(
                    "block_tables", f"session {i} uses block ids in [{lo}, {hi}]; the pool has {num_blocks}"
                )


def _triton_module() -> Any:
    """treespec_kernels._triton_tree_attention, imported on first use. Without CUDA, Triton can only
    interpret, so TRITON_INTERPRET=1 is set first when nothing has imported Triton yet."""
    if "triton" not in sys.modules and not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    try:
        from treespec_kernels import _triton_tree_attention
    except ImportError as exc:
        raise RuntimeError(
            f"tree_attention needs Triton ({exc}); install it with pip install 'treespec[gpu]'"
        ) from exc
    return _triton_tree_attention


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def _config(device: torch.device, dtype: torch.dtype, head_dim: int) -> tuple[int, int, int, int]:
    """(block_m, block_n, num_warps, num_stages) for a device, dtype and head_dim."""
    if device.type == "cpu":  # the interpreter: few, large numpy steps
        return 64, 64, 4, 1
    if dtype == torch.float32 or head_dim > 128:
        return 64, 32, 4, 2
    if head_dim == 128:
        return 128, 64, 8, 2
    return 128, 64, 4, 3


def tree_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    row_starts: torch.Tensor,
    cached_lens: torch.Tensor,
    tree_masks: torch.Tensor | None,
    causal: torch.Tensor | None,
    scale: float,
    block_size: int,
    *,
    check_values: bool = True,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """Attention of every session's packed rows over its paged KV cache, in one launch.

    q: [T, num_heads, head_dim]; k_cache, v_cache: [num_kv_heads, num_slots, head_dim], one layer of
    the pool (slot = block_id * block_size + offset); block_tables: [S, max_blocks] int32; row_starts:
    [S + 1] int32; cached_lens: [S] int32; tree_masks: [T] int64 or None (every session causal);
    causal: [S] bool or None (all causal). Returns [T, num_heads, head_dim] in q's dtype.

    check_values=False skips the checks that read index values (row_starts, cached lengths, tree
    sizes, block-table coverage and ids): each costs a device sync on a GPU, so a per-layer call in a
    model checks once per forward and passes False. block_m / block_n / num_warps / num_stages
    override the tuned launch shape (block_m: query heads x rows per program, a power of two >= 16).
    Raises ValueError naming the bad argument, RuntimeError when Triton is not installed.
    """
    _check(q, k_cache, v_cache, block_tables, row_starts, cached_lens, tree_masks, causal, scale,
           block_size, check_values)  # fmt: skip
    tk = _triton_module()
    if q.device.type != "cuda" and not tk.INTERPRETING:
        raise RuntimeError(
            f"tree_attention on {q.device.type} tensors runs in Triton's interpreter, which needs "
            "TRITON_INTERPRET=1 in the environment before Triton is first imported (set it, or use CUDA)"
        )
    t, heads, head_dim = q.shape
    kv_heads = k_cache.shape[0]
    s = row_starts.numel() - 1
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if t == 0 or s == 0:
        return out
    group = heads // kv_heads
    bm, bn, warps, stages = _config(q.device, q.dtype, head_dim)
    bm = max(block_m or bm, 16, _next_pow2(group))
    bn = block_n or bn
    for name, v in (("block_m", bm), ("block_n", bn)):
        if v < 16 or v & (v - 1):
            _fail(name, f"must be a power of two >= 16, got {v}")
    rows = bm // group
    has_tree = tree_masks is not None and causal is not None
    dummy = cached_lens  # never read when has_tree is False
    upcast = tk.INTERPRETING and q.dtype == torch.bfloat16
    grid = (-(-t // rows) + s, kv_heads)  # a bound on the sessions' row tiles; spare programs exit
    tk.tree_attention_fwd[grid](
        q, k_cache, v_cache, out, block_tables, row_starts, cached_lens,
        tree_masks if has_tree else dummy, causal if has_tree else dummy,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        out.stride(0), out.stride(1), block_tables.stride(0),
        s, block_size, float(scale) * math.log2(math.e),
        G=group, ROWS=rows, HD=head_dim, BLOCK_M=bm, BLOCK_N=bn, S_PAD=max(2, _next_pow2(s + 1)),
        HAS_TREE=has_tree, PRECISION="ieee" if q.dtype == torch.float32 or upcast else "tf32", UPCAST=upcast,
        num_warps=num_warps or warps, num_stages=num_stages or stages,
    )  # fmt: skip
    return out


def visibility(
    n: int, cached: int, is_causal: bool, masks: torch.Tensor | None, device: torch.device | None = None
) -> torch.Tensor:
    """[n, cached + n] bool: which positions each of a session's n new rows may see (masks: [n] int64)."""
    allowed = torch.ones(n, cached + n, dtype=torch.bool, device=device)
    if is_causal:
        allowed[:, cached:] = torch.ones(n, n, dtype=torch.bool, device=device).tril_()
        return allowed
    assert masks is not None
    bits = (masks.to(device).view(n, 1) >> torch.arange(64, device=device)) & 1  # [n, 64]
    new = torch.zeros(n, n, dtype=torch.bool, device=device)
    new[:, 1:] = bits[:, : n - 1] != 0
    new[:, 0] = True
    new.diagonal().fill_(True)
    allowed[:, cached:] = new
    return allowed


def reference_tree_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    row_starts: torch.Tensor,
    cached_lens: torch.Tensor,
    tree_masks: torch.Tensor | None,
    causal: torch.Tensor | None,
    scale: float,
    block_size: int,
) -> torch.Tensor:
    """`tree_attention` in plain torch: per session, gather its keys through the block table, build
    the dense [n, cached + n] mask, softmax in float32. The oracle of the tests (and slow)."""
    _check(q, k_cache, v_cache, block_tables, row_starts, cached_lens, tree_masks, causal, scale,
           block_size, True)  # fmt: skip
    heads, kv_heads = q.shape[1], k_cache.shape[0]
    group = heads // kv_heads
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    rs, cached = row_starts.tolist(), cached_lens.tolist()
    kinds = [True] * len(cached) if causal is None else causal.tolist()
    for i, c in enumerate(cached):
        a, b = rs[i], rs[i + 1]
        n = b - a
        if n == 0:
            continue
        pos = torch.arange(c + n, device=q.device)
        slots = block_tables[i].long()[pos // block_size] * block_size + pos % block_size
        k = k_cache[:, slots].float().repeat_interleave(group, 0)  # [heads, L, head_dim]
        v = v_cache[:, slots].float().repeat_interleave(group, 0)  # [heads, L, head_dim]
        masks = None if tree_masks is None else tree_masks[a:b]
        allowed = visibility(n, c, kinds[i], masks, q.device)  # [n, L]
        scores = q[a:b].float().transpose(0, 1) @ k.transpose(1, 2) * scale  # [heads, n, L]
        probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        out[a:b] = (probs @ v).transpose(0, 1).to(q.dtype)
    return out
