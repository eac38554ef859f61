"""The float token table of a streamed model, left in the float-weight cache file (`TableRows`): a
forward reads its tokens' rows, each chunk checked against the entry's checksums.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from shared.model.disk_io import _DTYPE_BYTES, CHECK_BYTES, OffloadError, _digest


class TableRows:
    """A float token table left in the float-weight cache file: a forward reads the rows of its
    tokens (6 KB each for the 1.5B; the page cache keeps the frequent ones, outside this process's
    memory) instead of holding the table (0.93 GB for the 1.5B in fp32). The rows are read and
    checked in the entry's CHECK_BYTES chunks against the checksums the entry was written with
    (`digests`): every chunk a forward reads is checked, so a damaged table is an error naming the
    rows, never a wrong token. At start every chunk is checked once, unless weight_cache.load has
    just done so (`checked`)."""

    def __init__(self, path: Path, offset: int, shape: tuple[int, int], dtype: torch.dtype,
                 digests: Sequence[int], checked: bool = False, progress: bool = False) -> None:  # fmt: skip
        from tqdm import tqdm

        self.path, self.offset, self.shape, self.dtype = path, offset, shape, dtype
        self.row_bytes = shape[1] * torch.empty(0, dtype=dtype).element_size()
        self.nbytes = shape[0] * self.row_bytes
        if len(digests) != -(-self.nbytes // CHECK_BYTES):
            raise OffloadError(f"{path}: the token table has {len(digests)} checksums; rebuild the entry")
        self.digests = [int(d) for d in digests]
        self.fd = os.open(path, os.O_RDONLY)
        if not checked:  # a table damaged since the entry was made is refused at start
            try:
                for c in tqdm(
                    range(len(self.digests)), desc="checking the token table", disable=not progress
                ):
                    self._checked(c)
            except OffloadError:
                self.close()
                raise

    def _checked(self, c: int) -> bytes:
        """Chunk c's bytes, read and checked."""
        at = c * CHECK_BYTES
        n = min(CHECK_BYTES, self.nbytes - at)
        data = os.pread(self.fd, n, self.offset + at)
        rows = f"rows {at // self.row_bytes}..{(at + n - 1) // self.row_bytes}"
        if len(data) != n:
            raise OffloadError(
                f"{self.path}: the token table is truncated ({rows}); start again to rebuild it"
            )
        if _digest(memoryview(data)) != self.digests[c]:
            raise OffloadError(f"{self.path}: the token table's {rows} fail their checksum: the file is "
                               "corrupt; start again to rebuild it")  # fmt: skip
        return data

    def rows(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [T] -> [T, hidden]: the table's rows, read and checked."""
        ids = tokens.reshape(-1).tolist()
        out = torch.empty(len(ids), self.shape[1], dtype=self.dtype)
        chunks: dict[int, bytes] = {}
        for i, t in enumerate(ids):
            if not 0 <= t < self.shape[0]:
                raise IndexError(f"token {t} is outside the table of {self.shape[0]} rows")
            start, end = t * self.row_bytes, (t + 1) * self.row_bytes
            first, last = start // CHECK_BYTES, (end - 1) // CHECK_BYTES  # a row may span two chunks
            for c in range(first, last + 1):
                if c not in chunks:
                    chunks[c] = self._checked(c)
            raw = chunks[first] if first == last else b"".join(chunks[c] for c in range(first, last + 1))
            skip = start - first * CHECK_BYTES
            out[i] = torch.frombuffer(bytearray(raw[skip : skip + self.row_bytes]), dtype=self.dtype)
        return out.to(tokens.device)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def table_on_disk(model: Any, head: Any, entry: Path, checked: bool, progress: bool) -> TableRows | None:
    """Leave the float token table of `model` in its cache entry (TableRows) and free it, where
    nothing else uses it (`head`, the head as the model will run it, is a packed copy or another
    matrix); None otherwise. `checked`: as float_layout's."""
    if model.weights == "quantized" or head is model.embed or model.device.type != "cpu":
        return None
    header = json.loads((entry / "header.json").read_text(encoding="utf-8"))
    spec = next((p for p in header["params"] if p["name"] == "embed"), None)
    shape = [model.config.vocab_size, model.config.hidden_size]
    if spec is None or spec["dtype"] not in _DTYPE_BYTES or spec["shape"] != shape:
        if model.embed.numel() == 0:
            raise OffloadError(f"{entry}: no token table of shape {shape} to read rows from; rebuild it")
        return None
    dtype = getattr(torch, spec["dtype"])
    table = TableRows(
        entry / "weights.bin",
        int(spec["offset"]),
        (shape[0], shape[1]),
        dtype,
        spec["digests"],
        checked,
        progress,
    )
    model.embed.data = model.embed.data.new_empty(0)
    return table
