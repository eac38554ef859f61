"""Checksums of stored bytes, for every cache that must never serve damaged or swapped data: the
verifier's weight cache and streamed weights (shared.model.disk_io) and the edge's ONNX exports
(edge_client.onnx.export). No torch here, so the edge can use it without the cloud's packages."""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence
from pathlib import Path


def _hasher() -> tuple[str, Callable[[memoryview], int]]:
    """The checksum: xxh3-64 (~14 GB/s on one core here, releasing the GIL) when xxhash is
    installed, else CRC-32 (~3 GB/s): it runs on every read, beside the forward."""
    try:
        import xxhash

        return "xxh3_64", xxhash.xxh3_64_intdigest
    except ImportError:
        return "crc32", zlib.crc32


HASH, _digest = _hasher()

# The checksum unit: bytes from the start of a parameter (or file), in chunks of this many (the last
# one shorter), each with its own digest
CHECK_BYTES = 1 << 18
_FILE_READ = 256 * CHECK_BYTES  # bytes per read while checksumming a file (64 MiB)


def chunk_digests(data: memoryview) -> list[int]:
    """The digest of every CHECK_BYTES chunk of `data` (a parameter's bytes from its start)."""
    return [_digest(data[a : a + CHECK_BYTES]) for a in range(0, len(data), CHECK_BYTES)]


def first_bad_chunk(data: memoryview, digests: Sequence[int], first: int = 0) -> int | None:
    """The first chunk of `data` (chunks first, first + 1, ... of a parameter, whole) whose digest is
    not its entry in `digests`; None when all match."""
    for k, a in enumerate(range(0, len(data), CHECK_BYTES)):
        if first + k >= len(digests) or _digest(data[a : a + CHECK_BYTES]) != digests[first + k]:
            return first + k
    return None


def file_checksum(path: Path) -> str:
    """ "HASH:hex" of a whole file: the digest of its chunks' digests (chunk_digests, each as 8
    little-endian bytes), read _FILE_READ bytes at a time, so any size costs bounded memory and
    one changed byte anywhere changes it."""
    buf = memoryview(bytearray(_FILE_READ))
    digests: list[int] = []
    with path.open("rb", buffering=0) as f:
        while True:
            n = 0
            while n < len(buf) and (got := f.readinto(buf[n:])):
                n += got
            digests += chunk_digests(buf[:n])
            if n < len(buf):
                break
    root = _digest(memoryview(b"".join(d.to_bytes(8, "little") for d in digests)))
    return f"{HASH}:{root:016x}"
