"""The output head of a streamed float model (offload.attach): read from the float-weight cache file
in chunks of HEAD_CHUNK_ROWS vocabulary rows (48 MB of the 1.5B's 0.93 GB fp32 head), each checked
against its checksum, and either packed once into memory (a head that fits the resident budget) or
streamed for every forward like a layer: two read buffers, the next chunk read and packed on a
background thread while this one is multiplied (`StreamedRows`).

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
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from shared.model import llama
from shared.model.disk_io import (
    _DTYPE_BYTES,
    ALIGN,
    CHECKSUM_FORMAT,
    HASH,
    DiskReader,
    OffloadError,
    StreamStats,
    _digest,
    _save_sidecar,
    _view,
    aligned_buffer,
)


class HeadFile:
    """The head [vocab, hidden] in the float-weight cache file `path` at `offset`, read a chunk of
    `rows` rows at a time (O_DIRECT where `direct`) and checked against per-chunk checksums: computed
    the first time and kept in `sidecar`, every chunk checked against them at each later start (a
    file damaged since is refused there), and on every read."""

    def __init__(self, path: Path, offset: int, shape: tuple[int, int], dtype: str, sidecar: Path,
                 direct: bool = True, progress: bool = False) -> None:  # fmt: skip
        self.path, self.offset, self.shape = path, offset, shape
        self.dtype = getattr(torch, dtype)
        self.row_bytes = shape[1] * _DTYPE_BYTES[dtype]
        self.rows = llama.HEAD_CHUNK_ROWS
        self.count = -(-shape[0] // self.rows)
        self.reader = DiskReader(path, 1, direct=direct)
        # an aligned span around any chunk: the chunk's bytes plus up to ALIGN on each side
        self.span_bytes = self.rows * self.row_bytes + 2 * ALIGN
        self.digests: list[int] = []
        self.digests = self._checksums(sidecar, progress)

    @property
    def nbytes(self) -> int:
        return self.shape[0] * self.row_bytes

    @property
    def stream_bytes(self) -> int:
        """Memory a stream of this head takes: two read buffers and two packed chunks (one multiplied,
        the next being packed)."""
        return 2 * (self.span_bytes + self.rows * self.row_bytes)

    def buffer(self) -> torch.Tensor:
        """A read buffer for one chunk."""
        return aligned_buffer(self.span_bytes)

    def read(self, c: int, buf: torch.Tensor) -> torch.Tensor:
        """Chunk c [rows, hidden] (a view of `buf`), checked against its checksum when known."""
        first = c * self.rows
        n = min(self.rows, self.shape[0] - first)
        start = self.offset + first * self.row_bytes
        aligned = start // ALIGN * ALIGN
        length = -(-(start + n * self.row_bytes - aligned) // ALIGN) * ALIGN
        got = self.reader.read(buf, aligned, length)
        lo, hi = start - aligned, start - aligned + n * self.row_bytes
        if got < hi:
            raise OffloadError(f"{self.path}: the head is truncated (rows {first}..{first + n - 1}); "
                               "delete the cache entry and start again to rebuild it")  # fmt: skip
        data = buf[lo:hi]
        if self.digests and _digest(_view(data)) != self.digests[c]:
            raise OffloadError(f"{self.path}: the head's rows {first}..{first + n - 1} fail their checksum: "
                               "the file is corrupt; delete the cache entry and start again")  # fmt: skip
        return data.view(self.dtype).view(n, self.shape[1])

    def _checksums(self, sidecar: Path, progress: bool) -> list[int]:
        from tqdm import tqdm

        want = {"format": CHECKSUM_FORMAT, "hash": HASH, "offset": self.offset, "shape": list(self.shape),
                "chunk_rows": self.rows}  # fmt: skip
        buf = self.buffer()
        with contextlib.suppress(OSError, ValueError):
            saved = json.loads(sidecar.read_text(encoding="utf-8"))
            if {k: saved.get(k) for k in want} == want and len(saved.get("digests", [])) == self.count:
                self.digests = [int(d) for d in saved["digests"]]
                for c in tqdm(range(self.count), desc="checking the head", disable=not progress):
                    self.read(c, buf)
                return self.digests
        digests = []
        for c in tqdm(range(self.count), desc="checksumming the head", disable=not progress):
            digests.append(_digest(_view(self.read(c, buf))))  # (self.digests is empty: not checked)
        _save_sidecar(sidecar, {**want, "digests": digests}, "the head's checksums")
        return digests

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


def head_sidecar(layer_sidecar: Path | None, weights: Path) -> Path:
    """Where the head's checksums are kept: beside the layers' (a `.head.json` of their sidecar)."""
    if layer_sidecar is not None:
        return layer_sidecar.with_suffix(".head.json")
    from shared import model_store

    return model_store.cache_dir() / "offload" / f"{model_store.content_id(weights)}.head.json"


def open_head(entry: Path, sidecar: Path | None, direct: bool, progress: bool) -> HeadFile | None:
    """The untied float head of a cache entry, ready to read (None when the head is the token table)."""
    spec = head_entry(entry)
    if spec is None:
        return None
    weights = entry / "weights.bin"
    if not os.path.exists(weights):
        raise OffloadError(f"{weights} is missing: delete the cache entry {entry} and start again")
    shape = (int(spec["shape"][0]), int(spec["shape"][1]))
    return HeadFile(weights, int(spec["offset"]), shape, spec["dtype"], head_sidecar(sidecar, weights),
                    direct, progress)  # fmt: skip
