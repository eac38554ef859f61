"""shared.checksum.file_checksum: a whole file's checksum, read a bounded buffer at a time, the same
whatever the buffer size, and changed by any changed byte (in any chunk, the last one included)."""

from __future__ import annotations

from pathlib import Path

import pytest

from shared import checksum
from shared.checksum import CHECK_BYTES, HASH, file_checksum


@pytest.mark.parametrize("size", [0, 1, CHECK_BYTES, 3 * CHECK_BYTES + 17])
def test_file_checksum_is_the_files_content(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, size: int
) -> None:
    data = bytes((i * 7) % 251 for i in range(size))
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    whole = file_checksum(path)
    assert whole.startswith(f"{HASH}:") and len(whole.partition(":")[2]) == 16
    monkeypatch.setattr(checksum, "_FILE_READ", CHECK_BYTES)  # a buffer of one chunk: same checksum
    assert file_checksum(path) == whole
    for at in {0, size // 2, size - 1} if size else set():
        changed = bytearray(data)
        changed[at] ^= 1
        path.write_bytes(bytes(changed))
        assert file_checksum(path) != whole, at
    path.write_bytes(data + b"\0")
    assert file_checksum(path) != whole
