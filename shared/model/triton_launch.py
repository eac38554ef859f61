"""The Triton tree-attention kernel (`treespec_kernels.tree_attention`) as the packed forward's attention.

One launch per layer serves every session of an engine step: the kernel reads each session's
keys through its block table straight from the paged pool, so nothing is gathered and no dense
mask is built. Per forward (not per layer, not per row) this module packs the launch's index
tensors with ONE host -> device copy (pinned, non-blocking on a GPU) and turns each tree session's
dense [n, n] mask into the kernel's per-row int64 bitmasks with a few vectorised ops on the device.

Sessions the kernel cannot take, tree sessions of more than 65 rows (a round whose tree comes with
a long committed tail, e.g. a prompt's first round), are marked `fallback`: the caller computes
their rows with SDPA (the kernel runs them as causal rows, and those outputs are overwritten).

Where Triton runs: CUDA tensors run the compiled kernel; CPU tensors run Triton's interpreter,
which needs TRITON_INTERPRET=1 in the environment before Triton is first imported (tests/conftest.py
sets it where there is no CUDA). `available` tells whether this device can use the kernel.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from shared.model.inputs import SeqInput
    from shared.model.kv_cache import PagedKVCache

MAX_TREE_ROWS = 65  # row 0 + 64 nodes: one int64 mask bit per node (treespec_kernels.tree_attention)
HEAD_DIMS = (16, 32, 64, 128, 256)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
ALIGN = 16  # int32 elements: a multiple of Triton's integer divisibility (16) and 16-byte alignment


def installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def available(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the kernel can serve this model here: Triton installed, a CUDA device (or a CPU
    under TRITON_INTERPRET=1, which is the caller's explicit choice, not a default), a supported
    dtype and head_dim."""
    return device.type == "cuda" and supports(dtype, head_dim) and installed()


def supports(dtype: torch.dtype, head_dim: int) -> bool:
    return dtype in DTYPES and head_dim in HEAD_DIMS


@dataclass(frozen=True)
class LaunchArgs:
    """The kernel's index tensors for one packed forward (the same for every layer)."""

    block_tables: torch.Tensor  # [S, max_blocks] int32
    row_starts: torch.Tensor  # [S + 1] int32
    cached_lens: torch.Tensor  # [S] int32
    tree_masks: torch.Tensor | None  # [T] int64 (0 on causal sessions' rows); None: all causal
    causal: torch.Tensor | None  # [S] bool; None: all causal
    fallback: tuple[int, ...]  # inputs whose rows the caller computes another way


def tree_bitmasks(mask: torch.Tensor) -> torch.Tensor:
    """[n, n] bool (row i may see row j) -> [n] int64: bit j-1 set iff row i sees new row j >= 1.

    Row 0 is always visible to the kernel, so the dense mask's column 0 must be all True (as every
    tree round's is). Bit 63 is int64's sign bit: distinct powers of two summed in int64 wrap to
    exactly the OR of the bits."""
    n = mask.shape[0]
    if n > MAX_TREE_ROWS:
        raise ValueError(f"a tree session has at most {MAX_TREE_ROWS} rows for the kernel, got {n}")
    if n == 1:
        return torch.zeros(1, dtype=torch.int64, device=mask.device)
    weights = torch.bitwise_left_shift(
        torch.ones(n - 1, dtype=torch.int64, device=mask.device),
        torch.arange(n - 1, dtype=torch.int64, device=mask.device),
    )
    return (mask[:, 1:].to(torch.int64) * weights).sum(-1)


def prepare(
    inputs: Sequence[SeqInput], cached: Sequence[int], kv: PagedKVCache, device: torch.device
) -> LaunchArgs:
    """The launch arguments of a forward whose sequences' scratch rows `kv.reserve` has made room
    for (block tables cover cached + n positions). cached: each input's committed length."""
    s = len(inputs)
    rows = [x.num_rows for x in inputs]
    fallback = tuple(i for i, x in enumerate(inputs) if x.tree_mask is not None and rows[i] > MAX_TREE_ROWS)
    is_causal = [x.tree_mask is None or i in fallback for i, x in enumerate(inputs)]
    tables = kv.block_tables_array([x.seq_id for x in inputs])  # [S, max_blocks]
    # Triton compiles a kernel per specialisation of its arguments: integers by divisibility by 16,
    # pointers by 16-byte alignment. A decode step's table grows a block every block_size tokens, so
    # an unpadded width and sections packed end to end would change the table's stride and the
    # sections' alignment as the sequence grows: a new compile (~1.4 s on an H200, seen at three
    # lengths between 1024 and 1072) in the middle of a session. Width and section starts are
    # rounded up to ALIGN elements, so the key does not depend on the lengths.
    width = _round_up(tables.shape[1], ALIGN)
    sizes = (s * width, s + 1, s, s)
    starts = np.concatenate(([0], np.cumsum([_round_up(n, ALIGN) for n in sizes])))
    host = np.zeros(int(starts[-1]), dtype=np.int32)
    host[: s * width].reshape(s, width)[:, : tables.shape[1]] = tables
    at_rows, at_cached, at_causal = int(starts[1]), int(starts[2]), int(starts[3])
    host[at_rows : at_rows + s + 1] = np.concatenate(([0], np.cumsum(rows)))
    host[at_cached : at_cached + s] = cached
    host[at_causal : at_causal + s] = is_causal
    dev = _to_device(host, device)  # the forward's one host -> device copy of indices
    block_tables = dev[: s * width].view(s, width)
    row_starts, cached_lens = dev[at_rows : at_rows + s + 1], dev[at_cached : at_cached + s]
    if all(is_causal):
        return LaunchArgs(block_tables, row_starts, cached_lens, None, None, fallback)
    parts = []
    for x, c in zip(inputs, is_causal, strict=True):
        if c or x.tree_mask is None:
            parts.append(torch.zeros(x.num_rows, dtype=torch.int64, device=device))
        else:
            parts.append(tree_bitmasks(x.tree_mask.to(device)))
    causal = dev[at_causal : at_causal + s].bool()
    return LaunchArgs(block_tables, row_starts, cached_lens, torch.cat(parts), causal, fallback)


def attend(
    q: torch.Tensor, kv: PagedKVCache, layer: int, args: LaunchArgs, scale: float, check: bool = False
) -> torch.Tensor:
    """q [T, heads, head_dim] (every session's rows, packed) -> [T, heads, head_dim] over one layer
    of the pool. check: also check the index values (reads them back: a sync on a GPU)."""
    from treespec_kernels.tree_attention import tree_attention

    return tree_attention(
        q,
        kv.k[layer],
        kv.v[layer],
        args.block_tables,
        args.row_starts,
        args.cached_lens,
        args.tree_masks,
        args.causal,
        scale,
        kv.block_size,
        check_values=check,
    )


def _round_up(n: int, k: int) -> int:
    return -(-n // k) * k


def _to_device(a: np.ndarray, device: torch.device) -> torch.Tensor:
    t = torch.from_numpy(a)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)
