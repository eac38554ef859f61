"""Projections kept as a GGUF's quantized blocks (`--weights quantized`): `QuantMatrix`, what
`LlamaModel.use_quantized` takes in place of its float projections, and how a model gets them.

A `QuantMatrix` is one or more parts stacked along the output rows (a fused q|k|v or gate|up whose
parts may be of different types: the 1.5B's v projection is Q6_K in half its layers, q and k
Q4_K), each a [rows, bytes] uint8 tensor of GGUF blocks. `linear` runs
`treespec_kernels.quant_matmul` per part (int8 activations, exact integer block sums, a fixed float
chain: a row's result never depends on the rows beside it) and concatenates; `rows` dequantizes
table rows exactly (the embedding lookup). Nothing is expanded to float32 and nothing is copied:
the blocks are views of the GGUF's memory map, so the 1.5B's projections, head and token table
are the file's 1.1 GB instead of 7.1 GB of floats.

The activations' int8 rounding makes this a numerically different target from the float32 one
(docs/architecture.md §4, "Quantized weights").
"""

from __future__ import annotations

import ctypes
import mmap
import sys
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from treespec_kernels import quant_matmul as qm


@dataclass(frozen=True)
class QuantPart:
    """Rows of a block matrix: `blocks` [rows, bytes per row] uint8 of type `qtype`; `packed`: the
    same blocks repacked for the kernel's packed path (`QuantMatrix.packed`), or None."""

    qtype: qm.QuantType
    blocks: torch.Tensor
    packed: torch.Tensor | None = None

    @property
    def rows(self) -> int:
        return int(self.blocks.shape[0])


class QuantMatrix:
    """A [out, in] projection as GGUF blocks (parts stacked along the output rows)."""

    def __init__(self, parts: Sequence[QuantPart], in_features: int) -> None:
        if not parts:
            raise ValueError("a QuantMatrix needs at least one part")
        for p in parts:
            want = qm.row_bytes(p.qtype, in_features)
            if p.blocks.dtype != torch.uint8 or p.blocks.dim() != 2 or p.blocks.shape[1] != want:
                raise ValueError(
                    f"a {p.qtype.name} part of {in_features} columns must be [rows, {want}] uint8, "
                    f"got {tuple(p.blocks.shape)} {p.blocks.dtype}"
                )
            if not p.blocks.is_contiguous():
                raise ValueError(f"a {p.qtype.name} part must be contiguous")
        # parts are kept as given, never concatenated: a part may be a view of the file's memory
        # map (gguf_part), and a copy would hold the bytes twice
        self.parts = tuple(parts)
        self.in_features = in_features
        self.out_features = sum(p.rows for p in self.parts)

    @property
    def nbytes(self) -> int:
        return sum(int(p.blocks.numel()) for p in self.parts)

    @property
    def types(self) -> tuple[str, ...]:
        return tuple(p.qtype.name for p in self.parts)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [rows, in] float32 -> [rows, out] float32 (+ bias, added after the product)."""
        if len(self.parts) == 1:
            p = self.parts[0]
            y = qm.quant_matmul(x, p.blocks, p.qtype, p.packed)
        else:  # x quantized once, every part writing its own columns
            y = qm.quant_matmul_parts(
                x,
                [p.blocks for p in self.parts],
                [p.qtype for p in self.parts],
                [p.packed for p in self.parts],
            )
        return y if bias is None else y + bias

    def packed(self) -> QuantMatrix:
        """This matrix with every part the kernel can repack repacked once (`quant_matmul.pack`): the
        same bits at every row count, a few rows at nearly the cost of one. The blocks are kept
        (the embedding lookup and the row counts outside `packed_rows` read them), so the repacked
        copy is memory of its own, about the blocks' size."""
        parts = []
        for p in self.parts:
            packed = qm.pack(p.blocks, p.qtype, self.in_features) if p.packed is None else None
            if packed is not None:
                p = QuantPart(p.qtype, p.blocks, packed)
                page_out(p.blocks)
            parts.append(p)
        if all(a is b for a, b in zip(parts, self.parts, strict=True)):
            return self  # nothing to pack (a tied table stays one matrix)
        return QuantMatrix(parts, self.in_features)

    @property
    def packed_nbytes(self) -> int:
        return sum(int(p.packed.numel()) for p in self.parts if p.packed is not None)

    @property
    def resident_nbytes(self) -> int:
        """The bytes the projections read: each part's packed copy where it has one, else its blocks."""
        return sum(int((p.blocks if p.packed is None else p.packed).numel()) for p in self.parts)

    @property
    def column_block(self) -> int:
        """Columns in one block of every part (32, or 256 with a K type): where a column cut may fall."""
        return max(p.qtype.values for p in self.parts)

    def take_rows(self, ranges: Sequence[tuple[int, int]]) -> QuantMatrix:
        """Output rows [a, b) for each (a, b) in order, stacked: views of the parts' blocks (a range
        that crosses parts becomes one part per part it touches). Tensor parallelism's column-parallel
        slice (this rank's q, k, v heads; its gate and up rows; its vocabulary rows)."""
        parts: list[QuantPart] = []
        for a, b in ranges:
            if not 0 <= a < b <= self.out_features:
                raise ValueError(f"rows [{a}, {b}) of a matrix of {self.out_features}")
            start = 0
            for p in self.parts:
                lo, hi = max(a, start), min(b, start + p.rows)
                if lo < hi:
                    parts.append(QuantPart(p.qtype, p.blocks[lo - start : hi - start]))
                start += p.rows
        return QuantMatrix(parts, self.in_features)

    def take_columns(self, a: int, b: int) -> QuantMatrix:
        """Input columns [a, b) (a copy of those blocks; row-parallel's slice: this rank's columns of o
        and down). The cut must fall on every part's block boundary: a block is one scale over its
        values, it cannot be split."""
        for p in self.parts:
            n = p.qtype.values
            if a % n or b % n or not 0 <= a < b <= self.in_features:
                raise ValueError(
                    f"columns [{a}, {b}) of a {p.qtype.name} matrix of {self.in_features} columns: a cut "
                    f"must fall on its {n}-value blocks"
                )
        parts = []
        for p in self.parts:
            n, size = p.qtype.values, p.qtype.bytes
            parts.append(QuantPart(p.qtype, p.blocks[:, a // n * size : b // n * size].contiguous()))
        return QuantMatrix(parts, b - a)

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """Rows `index` [n] as float32 [n, in], exactly as gguf-py dequantizes them."""
        if len(self.parts) != 1:
            raise ValueError("row lookup needs a single-part matrix (an embedding table)")
        p = self.parts[0]
        return qm.dequantize_rows(p.blocks, p.qtype, self.in_features, index)


_MADV_PAGEOUT = 21  # Linux 5.4+: reclaim these pages now (never destroys data: file pages are re-read)


def page_out(t: torch.Tensor) -> None:
    """Ask the kernel to reclaim the pages of t's memory (best effort, never destructive): the file
    pages of blocks the packed copy now serves leave the process's resident set instead of doubling
    it, and come back from the page cache or the file if read again (the embedding lookup)."""
    if sys.platform != "linux" or t.numel() == 0:
        return
    page = mmap.PAGESIZE
    start = -(-t.data_ptr() // page) * page
    end = (t.data_ptr() + t.numel() * t.element_size()) // page * page
    if end <= start:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), ctypes.c_int(_MADV_PAGEOUT))


def gguf_part(data: np.ndarray, type_name: str, shape: Sequence[int]) -> QuantPart:
    """A GGUF tensor's raw data (`ReaderTensor.data`, [out, bytes]) as a part; `shape` [out, in].

    No copy: the part is a view of `data` (the reader's read-only memory map of the file, which it
    keeps alive), so the weights are the file's pages, shared with the page cache as llama.cpp's
    are. The kernels only read them."""
    q = qm.qtype(type_name)
    arr = np.ascontiguousarray(np.asarray(data, dtype=np.uint8)).reshape(int(shape[0]), -1)
    with warnings.catch_warnings():  # torch warns that a read-only array could be written through
        warnings.simplefilter("ignore", UserWarning)
        blocks = torch.from_numpy(arr)
    if blocks.shape[1] != qm.row_bytes(q, int(shape[1])):
        raise ValueError(f"a {type_name} tensor of shape {tuple(shape)} has {blocks.shape[1]} bytes per row")
    return QuantPart(q, blocks)


def quantize_part(weight: torch.Tensor, type_name: str) -> QuantPart:
    """A float [out, in] weight quantized with gguf-py (the types it can quantize: Q8_0, Q5_0, Q4_1)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    q = qm.qtype(type_name)
    data = quantize(weight.detach().float().cpu().numpy(), GGMLQuantizationType[type_name])
    return QuantPart(q, torch.from_numpy(np.ascontiguousarray(data)).reshape(weight.shape[0], -1))
