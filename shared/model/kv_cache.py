"""Paged KV pool: fixed-size blocks, a free list, per-sequence block tables, tree scratch slots.

A sequence's positions [0, cached_len) are committed. A forward writes its n new rows (row 0 =
the last committed token, then tree nodes or a prefill chunk; docs/architecture.md §3.1) into the
*scratch* positions cached_len .. cached_len + n - 1, allocating blocks as needed. Nothing is
committed until the engine knows the verdict: `commit_rows` moves the kept rows' K/V down to the
contiguous positions after the prefix (a tree's accepted path is scattered through its rows) and
releases the blocks past the new end; `discard` drops the scratch.

Storage is one tensor per K and V, `[num_layers, num_kv_heads, num_blocks * block_size, head_dim]`,
so the positions of a block are adjacent for every head. When a sequence's blocks are consecutive
ids (the allocator tries hard to keep them so) attention reads its keys as a strided *view* of the
pool, with no gather; otherwise it gathers by slot index.

With `tiled_keys=True` (the batch-invariant CPU attention, treespec_kernels/cpu_attention.py) the
pool also keeps each layer's keys transposed within tiles of 16 slots, `kt[layer, head, slot // 16, :,
slot % 16]`, so that kernel loads 16 keys' worth of one dimension with one vector load. It is
written and moved together with `k`; the block size must then be a multiple of 16.

Refusals (`KVCacheFull`, bad ids, bad keep lists) are raised before anything is modified.

Threads: the engine's worker thread reserves, writes and commits the rows of the sequences in its
step while the event loop's thread adds and frees other sequences, so every method that changes
the block bookkeeping (the free map, block tables, lengths) holds the pool's lock.
"""

from __future__ import annotations

import functools
import itertools
import math
import mmap
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Concatenate, ParamSpec, TypeVar

import numpy as np
import torch

from treespec_kernels import cpu_attention

TILE = 16  # slots per key tile of `kt`


def _put_tiled(kt: torch.Tensor, slots: torch.Tensor, k: torch.Tensor) -> None:
    """kt: one layer's tiled keys [kv_heads, slots // TILE, head_dim, TILE]; k: [T, kv_heads, head_dim]."""
    # advanced indices on dims 1 and 3 put the row dimension first: [T, kv_heads, head_dim]
    kt[:, slots // TILE, :, slots % TILE] = k


def _tiled_writer() -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]:
    """The CPU kernel's plain-loop writer when it is built (an advanced-index put starts a
    parallel region per layer: ~0.1 ms each for a 16-row tree with sleeping OpenMP waiters)."""
    mod = cpu_attention.load()
    if mod is None:
        return _put_tiled
    writer: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None] = mod.write_tiled
    return writer


def _to_device(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array on `device`; on a GPU pinned and non-blocking (a pageable copy would wait for
    every kernel queued before it)."""
    t = torch.from_numpy(a)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


class KVCacheFull(Exception):
    """The pool has too few free blocks for a request; nothing was allocated or changed."""

    def __init__(self, needed: int, free: int, detail: str = "") -> None:
        extra = f" ({detail})" if detail else ""
        super().__init__(f"KV cache full: {needed} more block(s) needed but only {free} free{extra}")
        self.needed = needed
        self.free = free


@dataclass
class _Seq:
    blocks: list[int] = field(default_factory=list)  # block table: block id of each block_size run
    cached: int = 0  # committed positions
    scratch: int = 0  # uncommitted rows written by the last forward, at positions cached..


@dataclass(frozen=True)
class SeqSlots:
    """Where one sequence's rows of a forward live in the pool.

    write:  [n] int64 pool slots of the n new rows.
    read:   (start, stop) when positions [0, cached + n) are one run of slots (a view), else
            [cached + n] int64 slots to gather.
    """

    write: torch.Tensor
    read: tuple[int, int] | torch.Tensor


_P = ParamSpec("_P")
_R = TypeVar("_R")


def _locked(
    method: Callable[Concatenate[PagedKVCache, _P], _R],
) -> Callable[Concatenate[PagedKVCache, _P], _R]:
    """Run a PagedKVCache method under the pool's lock."""

    @functools.wraps(method)
    def run(self: PagedKVCache, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        with self._lock:
            return method(self, *args, **kwargs)

    return run


def zeros_on_use(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor whose memory is taken as it is written. On a CPU the pool is sized from the
    memory available (kv_memory_fraction), so `torch.zeros` would take all of it at once and
    every verifier in a process would hold its whole pool; an anonymous mapping reads as zeros and
    the kernel gives it pages only where a block is written, so the process holds what its
    sessions use. Other devices allocate as usual."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    count = math.prod(shape)
    size = count * torch.empty((), dtype=dtype).element_size()
    buf = mmap.mmap(-1, max(size, 1))  # anonymous: zero-filled, committed page by page
    return torch.frombuffer(buf, dtype=dtype, count=count).view(shape)


class PagedKVCache:
    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        tiled_keys: bool = False,
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        if tiled_keys and block_size % TILE:
            raise ValueError(f"tiled keys need a block size that is a multiple of {TILE}, got {block_size}")
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.block_size = block_size
        self.dtype = dtype
        self.device = torch.device(device)
        shape = (num_layers, num_kv_heads, num_blocks * block_size, head_dim)
        self.k = zeros_on_use(shape, dtype, self.device)  # [layers, kv_heads, slots, head_dim]
        self.v = zeros_on_use(shape, dtype, self.device)  # [layers, kv_heads, slots, head_dim]
        # [layers, kv_heads, slots // TILE, head_dim, TILE]: the keys again, transposed per tile
        self.kt = (
            zeros_on_use(
                (num_layers, num_kv_heads, num_blocks * block_size // TILE, head_dim, TILE),
                dtype,
                self.device,
            )
            if tiled_keys
            else None
        )
        self._write_tiled = _tiled_writer() if tiled_keys else _put_tiled
        self._free = np.ones(num_blocks, dtype=bool)
        self._num_free = num_blocks
        self._lock = threading.RLock()  # the bookkeeping; see the module doc
        self._seqs: dict[int, _Seq] = {}

    # ------------------------------------------------------------------ accounting
    @property
    def num_blocks(self) -> int:
        return int(self._free.size)

    @property
    def num_free_blocks(self) -> int:
        return self._num_free

    @property
    def blocks_in_use(self) -> int:
        return self.num_blocks - self._num_free

    def sequences(self) -> list[int]:
        return list(self._seqs)

    def cached_len(self, seq_id: int) -> int:
        return self._seq(seq_id).cached

    def scratch_len(self, seq_id: int) -> int:
        return self._seq(seq_id).scratch

    def block_table(self, seq_id: int) -> list[int]:
        return list(self._seq(seq_id).blocks)

    def block_tables(self, seq_ids: Sequence[int], device: torch.device | str | None = None) -> torch.Tensor:
        """[S, max_blocks] int32: the block tables of `seq_ids` (padded with block 0, never read
        past a sequence's positions), on `device` (default: the pool's), in one copy."""
        out = self.block_tables_array(seq_ids)
        return _to_device(out, torch.device(device) if device is not None else self.device)

    def block_tables_array(self, seq_ids: Sequence[int]) -> np.ndarray:
        """`block_tables` on the host: [S, max(1, max_blocks)] int32."""
        tables = [self._seq(sid).blocks for sid in seq_ids]
        width = max((len(b) for b in tables), default=0)
        out = np.zeros((len(tables), max(width, 1)), dtype=np.int32)
        for i, b in enumerate(tables):
            out[i, : len(b)] = b
        return out

    def _blocks_for(self, length: int) -> int:
        return -(-length // self.block_size)

    def _extra_blocks(self, seq: _Seq, n_rows: int) -> int:
        return max(0, self._blocks_for(seq.cached + n_rows) - len(seq.blocks))

    def can_fit(self, seq_id: int, n_rows: int) -> bool:
        return self._extra_blocks(self._seq(seq_id), n_rows) <= self._num_free

    def blocks_needed(self, seq_id: int, n_rows: int) -> int:
        """Free blocks a forward of `n_rows` new rows of this sequence would take."""
        return self._extra_blocks(self._seq(seq_id), n_rows)

    def blocks_held(self, seq_id: int) -> int:
        return len(self._seq(seq_id).blocks)

    def blocks_for(self, length: int) -> int:
        """Blocks that hold `length` positions."""
        return self._blocks_for(length)

    def _seq(self, seq_id: int) -> _Seq:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise KeyError(f"sequence {seq_id} is not in the KV cache") from None

    # ------------------------------------------------------------------ lifecycle
    @_locked
    def add(self, seq_id: int) -> None:
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id} is already in the KV cache")
        self._seqs[seq_id] = _Seq()

    @_locked
    def free(self, seq_id: int) -> None:
        """Release every block of the sequence and forget it."""
        seq = self._seq(seq_id)
        self._release(seq.blocks)
        del self._seqs[seq_id]

    @_locked
    def discard(self, seq_id: int) -> None:
        """Drop the uncommitted scratch rows of the last forward."""
        seq = self._seq(seq_id)
        seq.scratch = 0
        self._trim(seq)

    @_locked
    def truncate(self, seq_id: int, length: int) -> None:
        """Forget committed positions from `length` on (and any scratch)."""
        seq = self._seq(seq_id)
        if not 0 <= length <= seq.cached:
            raise ValueError(f"cannot truncate sequence {seq_id} of length {seq.cached} to {length}")
        seq.cached, seq.scratch = length, 0
        self._trim(seq)

    @_locked
    def commit_rows(self, seq_id: int, keep: Sequence[int]) -> None:
        """Keep scratch rows `keep` (increasing) at positions cached_len, cached_len + 1, ...

        A tree's accepted path is scattered through the scratch rows, so rows are moved down; the
        moves run on every layer at once. Rows already in place (the usual case for row 0 and a
        prefill tail) are not touched.
        """
        seq = self._seq(seq_id)
        idx = [int(i) for i in keep]
        if any(b <= a for a, b in itertools.pairwise(idx)):
            raise ValueError(f"keep must be strictly increasing, got {idx}")
        if idx and (idx[0] < 0 or idx[-1] >= seq.scratch):
            raise ValueError(f"keep indices must be in [0, {seq.scratch}) (the scratch rows), got {idx}")
        first_move = next((j for j, i in enumerate(idx) if i != j), len(idx))
        if first_move < len(idx):
            src = self._slots(seq, [seq.cached + i for i in idx[first_move:]])
            dst = self._slots(seq, [seq.cached + j for j in range(first_move, len(idx))])
            # advanced indexing reads a copy first, so overlapping source and destination are safe
            self.k[:, :, dst] = self.k[:, :, src]
            self.v[:, :, dst] = self.v[:, :, src]
            if self.kt is not None:
                self.kt[:, :, dst // TILE, :, dst % TILE] = self.kt[:, :, src // TILE, :, src % TILE]
        seq.cached += len(idx)
        seq.scratch = 0
        self._trim(seq)

    def commit(self, seq_id: int, accepted_nodes: Sequence[int]) -> None:
        """A tree round (row 0 + nodes as rows 1..N): store row 0 and the accepted path's nodes."""
        self.commit_rows(seq_id, [0, *(1 + int(i) for i in accepted_nodes)])

    # ------------------------------------------------------------------ used by the forward
    @_locked
    def reserve(self, requests: Sequence[tuple[int, int]]) -> list[SeqSlots]:
        """Make scratch room for (seq_id, n_rows) of one forward, all or nothing.

        Any earlier uncommitted scratch of these sequences is replaced.
        """
        seqs = [self._seq(sid) for sid, _ in requests]
        if len({sid for sid, _ in requests}) != len(requests):
            raise ValueError("a sequence may appear only once in a forward")
        needed = sum(self._extra_blocks(s, n) for s, (_, n) in zip(seqs, requests, strict=True))
        if needed > self._num_free:
            raise KVCacheFull(needed, self._num_free, f"for {sum(n for _, n in requests)} new rows")
        out = []
        for seq, (_, n) in zip(seqs, requests, strict=True):
            seq.scratch = n
            self._trim(seq)
            self._grow(seq, self._extra_blocks(seq, n))
            out.append(self._layout(seq))
        return out

    def layer_kv(self, layer: int, read: tuple[int, int] | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v), each [kv_heads, length, head_dim], of one sequence's positions on one layer."""
        if isinstance(read, tuple):
            a, b = read
            return self.k[layer, :, a:b], self.v[layer, :, a:b]
        return self.k[layer].index_select(1, read), self.v[layer].index_select(1, read)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """slots: [T] int64; k, v: [T, kv_heads, head_dim] -> stored at those slots."""
        self.k[layer].index_copy_(1, slots, k.transpose(0, 1).to(self.dtype))
        self.v[layer].index_copy_(1, slots, v.transpose(0, 1).to(self.dtype))
        if self.kt is not None:
            self._write_tiled(self.kt[layer], slots, k.to(self.dtype))

    def layer_pool(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(k, v, kt) of one layer's whole pool, for a kernel that stores rows itself:
        [kv_heads, slots, head_dim] twice and the tiled keys [kv_heads, slots // 16, head_dim, 16]."""
        if self.kt is None:
            raise ValueError("this pool was made without tiled_keys")
        return self.k[layer], self.v[layer], self.kt[layer]

    def layer_tiled(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(kt, v) of one layer's whole pool for the tiled-key kernel: [kv_heads, slots // 16,
        head_dim, 16] and [kv_heads, slots, head_dim]."""
        if self.kt is None:
            raise ValueError("this pool was made without tiled_keys")
        return self.kt[layer], self.v[layer]

    @staticmethod
    def read_slots(read: tuple[int, int] | torch.Tensor) -> torch.Tensor:
        """A SeqSlots.read as an int64 slot per position."""
        if isinstance(read, tuple):
            return torch.arange(read[0], read[1], dtype=torch.int64)
        return read

    def sequence_kv(self, seq_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v), each [layers, kv_heads, cached_len, head_dim]: the committed cache, gathered."""
        seq = self._seq(seq_id)
        slots = self._slots(seq, range(seq.cached))
        return self.k[:, :, slots], self.v[:, :, slots]

    # ------------------------------------------------------------------ internals
    def _slots(self, seq: _Seq, positions: Sequence[int] | range) -> torch.Tensor:
        pos = np.asarray(positions, dtype=np.int64)
        table = np.asarray(seq.blocks, dtype=np.int64)
        slots = table[pos // self.block_size] * self.block_size + pos % self.block_size
        return _to_device(slots, self.device)

    def _layout(self, seq: _Seq) -> SeqSlots:
        end = seq.cached + seq.scratch
        write = self._slots(seq, range(seq.cached, end))
        b = seq.blocks
        if b and (len(b) == 1 or bool(np.all(np.diff(b) == 1))):  # consecutive block ids
            start = b[0] * self.block_size
            return SeqSlots(write, (start, start + end))
        return SeqSlots(write, self._slots(seq, range(end)))

    def _trim(self, seq: _Seq) -> None:
        keep = self._blocks_for(seq.cached + seq.scratch)
        if len(seq.blocks) > keep:
            self._release(seq.blocks[keep:])
            del seq.blocks[keep:]

    def _release(self, blocks: Sequence[int]) -> None:
        self._free[list(blocks)] = True
        self._num_free += len(blocks)

    def _grow(self, seq: _Seq, count: int) -> None:
        """Append `count` free blocks to the table, consecutive with its last block when possible."""
        while count:
            start = seq.blocks[-1] + 1 if seq.blocks else -1
            if not (0 <= start < self.num_blocks and self._free[start]):
                start = self._pick_start()
            stop = start
            while stop < self.num_blocks and stop - start < count and self._free[stop]:
                stop += 1
            self._free[start:stop] = False
            self._num_free -= stop - start
            seq.blocks.extend(range(start, stop))
            count -= stop - start

    def _pick_start(self) -> int:
        """The first block of a new run: in the largest free run, mid-way when a sequence ends
        just before it (so that sequence can still grow in place), else at its start."""
        f = np.concatenate(([False], self._free, [False])).astype(np.int8)
        edges = np.diff(f)
        starts = np.flatnonzero(edges == 1)
        lengths = np.flatnonzero(edges == -1) - starts
        i = int(np.argmax(lengths))
        start, length = int(starts[i]), int(lengths[i])
        return start + length // 2 if start > 0 else start
