"""The output head of a streamed float model (offload.attach): read from the float-weight cache file
in chunks of HEAD_CHUNK_ROWS vocabulary rows (48 MB of the 1.5B's 0.93 GB fp32 head), each checked
against the checksums the cache entry was written with, and either packed once into memory (a head
that fits the resident budget) or streamed for every forward like a layer: two read buffers, the
next chunk read and packed on a background thread while this one is multiplied (`StreamedRows`).

Either way the head runs as `RowChunks` (shared/model/llama.py), chunk by chunk, as a resident
model's oneDNN head does, so the logits are the same bits. The head's full matrix is never held:
the start's peak is the packed chunks plus one chunk read, not the head twice.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from shared.model import llama
from shared.model.disk_io import (
    _DTYPE_BYTES,
    ALIGN,
    CHECK_BYTES,
    DiskReader,
    OffloadError,
    StreamStats,
    _view,
    aligned_buffer,
    chunk_window,
    first_bad_chunk,
)


class HeadFile:
    """The head [vocab, hidden] in the float-weight cache file `path` at `offset`, read a chunk of
    `rows` rows at a time (O_DIRECT where `direct`) and checked against the checksums the cache
    entry was written with (`digests`, one per CHECK_BYTES of the head's bytes): on every read, and
    every chunk once at start unless weight_cache.load has just checked them (`checked`)."""

    def __init__(self, path: Path, offset: int, shape: tuple[int, int], dtype: str, digests: Sequence[int],
                 direct: bool = True, progress: bool = False, checked: bool = False) -> None:  # fmt: skip
        from tqdm import tqdm

        self.path, self.offset, self.shape = path, offset, shape
        self.dtype = getattr(torch, dtype)
        self.row_bytes = shape[1] * _DTYPE_BYTES[dtype]
        self.rows = llama.HEAD_CHUNK_ROWS
        self.count = -(-shape[0] // self.rows)
        if len(digests) != -(-self.nbytes // CHECK_BYTES):
            raise OffloadError(f"{path}: the head has {len(digests)} checksums; rebuild the cache entry")
        self.digests = [int(d) for d in digests]
        self.reader = DiskReader(path, 1, direct=direct)
        # the longest read: a chunk's rows widened to the whole checksum chunks they touch
        self.span_bytes = max(self._window(c)[3] for c in range(self.count))
        if not checked:  # a head damaged since the entry was made is refused at start
            buf = self.buffer()
            try:
                for c in tqdm(range(self.count), desc="checking the head", disable=not progress):
                    self.read(c, buf)
            except OffloadError:
                self.reader.close()
                raise

    @property
    def nbytes(self) -> int:
        return self.shape[0] * self.row_bytes

    def _window(self, c: int) -> tuple[int, int, int, int]:
        """Chunk c's read: its first checksum chunk, the checked bytes [start, end) of the head, and
        the read's length (end - start up to ALIGN, for O_DIRECT; start is a page boundary)."""
        first = c * self.rows
        n = min(self.rows, self.shape[0] - first)
        k, start, end = chunk_window(first * self.row_bytes, (first + n) * self.row_bytes, self.nbytes)
        return k, start, end, -(-(end - start) // ALIGN) * ALIGN

    @property
    def stream_bytes(self) -> int:
        """Memory a stream of this head takes: two read buffers and two packed chunks (one multiplied,
        the next being packed)."""
        return 2 * (self.span_bytes + self.rows * self.row_bytes)

    def buffer(self) -> torch.Tensor:
        """A read buffer for one chunk."""
        return aligned_buffer(self.span_bytes)

    def read(self, c: int, buf: torch.Tensor) -> torch.Tensor:
        """Chunk c [rows, hidden] (a view of `buf`), checked against its checksums."""
        first = c * self.rows
        n = min(self.rows, self.shape[0] - first)
        k, start, end, length = self._window(c)
        got = self.reader.read(buf, self.offset + start, length)
        if got < end - start:
            raise OffloadError(f"{self.path}: the head is truncated (rows {first}..{first + n - 1}); "
                               "start again to rebuild the cache entry")  # fmt: skip
        if first_bad_chunk(_view(buf[: end - start]), self.digests, k) is not None:
            raise OffloadError(f"{self.path}: the head's rows {first}..{first + n - 1} fail their checksum: "
                               "the file is corrupt; start again to rebuild the cache entry")  # fmt: skip
        lo = first * self.row_bytes - start
        return buf[lo : lo + n * self.row_bytes].view(self.dtype).view(n, self.shape[1])

    def close(self) -> None:
        self.reader.close()


def resident_head(source: HeadFile, pack: Callable[[torch.Tensor], torch.Tensor]) -> llama.RowChunks:
    """The head packed into memory a chunk at a time (never the whole raw matrix)."""
    buf = source.buffer()
    parts = [pack(source.read(c, buf)) for c in range(source.count)]
    return llama.RowChunks(parts, source.rows, source.shape[0], source.shape[1])


class StreamedRows(llama.RowChunks):
    """A head streamed from its HeadFile for every forward: chunk c+1 is read, checked and packed on a
    background thread while chunk c is multiplied; after the last chunk the first one of the next
    forward is made ready. Time and bytes go to `stats()` (the streamed layers' counters)."""

    def __init__(self, source: HeadFile, pack: Callable[[torch.Tensor], torch.Tensor],
                 stats: Callable[[], StreamStats], lock: threading.Lock) -> None:  # fmt: skip
        super().__init__([], source.rows, source.shape[0], source.shape[1])
        self.source, self.pack, self.stats, self.lock = source, pack, stats, lock
        self.buffers = [source.buffer(), source.buffer()]
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="offload-head")
        self._jobs: list[tuple[int, int, Future[torch.Tensor]]] = []  # (chunk, buffer, read + pack)
        self._submit(0, 0)

    @property
    def buffer_bytes(self) -> int:
        """Memory the stream takes (HeadFile.stream_bytes)."""
        return self.source.stream_bytes

    def _load(self, c: int, b: int) -> torch.Tensor:
        t0 = time.perf_counter()
        raw = self.source.read(c, self.buffers[b])
        packed = self.pack(raw)  # a copy (oneDNN): the buffer is free once this returns
        with self.lock:
            s = self.stats()
            s.read_s += time.perf_counter() - t0
            s.bytes_read += raw.numel() * raw.element_size()
        return packed

    def _submit(self, c: int, b: int) -> None:
        self._jobs.append((c, b, self._pool.submit(self._load, c, b)))

    def _first(self) -> None:
        """Leave one job: chunk 0's, the one made ready after the last forward or (after a forward that
        stopped midway, or a failed read) a new one."""
        while self._jobs:
            c, _, fut = self._jobs[0]
            if c == 0 and len(self._jobs) == 1 and not (fut.done() and fut.exception() is not None):
                return
            self._jobs.pop(0)
            with contextlib.suppress(Exception):
                fut.result()
        self._submit(0, 0)

    def chunks(self) -> Iterator[torch.Tensor]:
        n = self.source.count
        self._first()
        for c in range(n):
            _, b, fut = self._jobs[0]
            t0 = time.perf_counter()
            try:
                packed = fut.result()
            finally:
                with self.lock:
                    self.stats().wait_s += time.perf_counter() - t0
            self._jobs.pop(0)
            self._submit((c + 1) % n, 1 - b)  # after the last chunk: the next forward's first
            yield packed

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self.source.close()


def head_entry(entry: Path) -> dict[str, Any] | None:
    """The float-weight cache entry's `lm_head` parameter (offset, shape, dtype), or None (a tied head)."""
    header = json.loads((entry / "header.json").read_text(encoding="utf-8"))
    spec = next((p for p in header["params"] if p["name"] == "lm_head"), None)
    if spec is None or spec["dtype"] not in _DTYPE_BYTES or len(spec["shape"]) != 2:
        return None
    return dict(spec)


def open_head(entry: Path, checked: bool, direct: bool, progress: bool) -> HeadFile | None:
    """The untied float head of a cache entry, ready to read (None when the head is the token table).
    `checked`: as offload.float_layout's."""
    spec = head_entry(entry)
    if spec is None:
        return None
    weights = entry / "weights.bin"
    if not os.path.exists(weights):
        raise OffloadError(f"{weights} is missing: delete the cache entry {entry} and start again")
    shape = (int(spec["shape"][0]), int(spec["shape"][1]))
    return HeadFile(weights, int(spec["offset"]), shape, spec["dtype"], spec["digests"], direct, progress,
                    checked)  # fmt: skip
