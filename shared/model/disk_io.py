"""Reading a streamed weight file (the offload's disk side, shared by the streamed layers and the
streamed head): page-aligned buffers, O_DIRECT reads split over threads, the checksum of every span,
the checksum sidecar's atomic write, and the stream's counters. No model code: `offload` and
`offload_head` both build on it."""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

# the checksums (torch-free, shared with the edge's exports), imported from here by the weight caches
from shared.checksum import CHECK_BYTES as CHECK_BYTES
from shared.checksum import HASH as HASH
from shared.checksum import _digest as _digest
from shared.checksum import chunk_digests as chunk_digests
from shared.checksum import first_bad_chunk as first_bad_chunk

log = logging.getLogger("shared.model.offload")

ALIGN = 4096  # O_DIRECT: offsets, lengths and buffers on page boundaries
CHUNK = 16 << 20  # bytes per read call within a span (split over the reader threads)
CHECKSUM_FORMAT = 1
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def chunk_window(start: int, end: int, nbytes: int) -> tuple[int, int, int]:
    """The whole chunks covering bytes [start, end) of a parameter of `nbytes` bytes: (the first
    chunk, the window's first byte, its end), the bytes to read so that each chunk can be checked."""
    first = start // CHECK_BYTES
    return first, first * CHECK_BYTES, min(-(-end // CHECK_BYTES) * CHECK_BYTES, nbytes)


class OffloadError(RuntimeError):
    """A streamed weight file is missing, truncated or corrupt (the message names which layer)."""


def aligned_buffer(nbytes: int, device: torch.device | None = None, pin: bool = False) -> torch.Tensor:
    """A uint8 tensor of `nbytes` whose data starts on an ALIGN boundary (O_DIRECT needs it)."""
    if device is not None and device.type != "cpu":
        return torch.empty(nbytes, dtype=torch.uint8, device=device)
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8, pin_memory=pin)
    skip = (-raw.data_ptr()) % ALIGN
    return raw[skip : skip + nbytes]


def _view(buf: torch.Tensor) -> memoryview:
    return buf.numpy().data.cast("B")


class DiskReader:
    """O_DIRECT reads of spans, split into CHUNK pieces over `threads` threads; `delay_s` per span
    simulates a slower disk (tests)."""

    def __init__(self, path: Path, threads: int = 1, direct: bool = True, delay_s: float = 0.0) -> None:
        flags = os.O_RDONLY | (getattr(os, "O_DIRECT", 0) if direct else 0)
        try:
            self.fd = os.open(path, flags)
        except OSError as exc:
            if direct and exc.errno == 22:  # EINVAL: a file system without O_DIRECT (tmpfs)
                log.warning("%s: O_DIRECT is not supported here; reading through the page cache", path)
                self.fd = os.open(path, os.O_RDONLY)
                direct = False
            else:
                raise OffloadError(f"cannot open {path}: {exc}") from exc
        self.direct = direct
        self.path = path
        self.delay_s = delay_s
        self.pool = ThreadPoolExecutor(max(1, threads) - 1) if threads > 1 else None
        self.threads = max(1, threads)

    def _pread(self, buf: torch.Tensor, offset: int) -> int:
        view, done = _view(buf), 0
        while done < len(view):
            n = os.preadv(self.fd, [view[done:]], offset + done)
            if n <= 0:
                break
            done += n
        return done

    def read(self, buf: torch.Tensor, offset: int, nbytes: int) -> int:
        """Read [offset, offset + nbytes) into buf[:nbytes]; the bytes read (short at the file's end)."""
        if self.delay_s:
            time.sleep(self.delay_s)
        pieces = [(a, min(CHUNK, nbytes - a)) for a in range(0, nbytes, CHUNK)]
        if self.pool is None or len(pieces) == 1:
            return sum(self._pread(buf[a : a + n], offset + a) for a, n in pieces)
        # the calling thread reads every `threads`-th piece, the pool the others
        futs = [
            self.pool.submit(self._read_pieces, buf, offset, pieces[k :: self.threads])
            for k in range(1, self.threads)
        ]
        got = self._read_pieces(buf, offset, pieces[0 :: self.threads])
        return got + sum(f.result() for f in futs)

    def _read_pieces(self, buf: torch.Tensor, offset: int, pieces: Sequence[tuple[int, int]]) -> int:
        return sum(self._pread(buf[a : a + n], offset + a) for a, n in pieces)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)
        os.close(self.fd)


def _save_sidecar(path: Path, doc: dict[str, Any], what: str) -> None:
    """Write a checksum sidecar atomically; a cache that cannot be written only costs a recount."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(doc), encoding="utf-8")
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("not saving %s (%s)", what, exc)


@dataclass
class StreamStats:
    """Counters since the start (or `reset`): what the forwards read and how long they waited."""

    forwards: int = 0
    layers_streamed: int = 0
    bytes_read: int = 0
    read_s: float = 0.0  # reader-thread time: read + checksum + pack, per streamed layer
    wait_s: float = 0.0  # time the forward stood waiting for a streamed layer
    forward_s: float = 0.0  # wall time inside the streamed iteration (start to last layer)

    def overlap(self) -> float | None:
        """Share of the transfer hidden behind compute: 1 - wait / transfer."""
        if self.read_s <= 0:
            return None
        return max(0.0, 1.0 - self.wait_s / self.read_s)

    def as_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["overlap"] = self.overlap()
        return d
