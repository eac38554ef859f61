"""File-system conditions tests arrange: a timestamp tick, a full disk."""

from __future__ import annotations

import errno
import os
from pathlib import Path


def after_a_timestamp_tick(path: Path) -> None:
    """Return once the file system's clock has moved past `path`'s ctime (file timestamps come
    from a coarse clock: a write within the same tick would leave the ctime as it was)."""
    probe = path.with_name(path.name + ".tick")
    probe.write_bytes(b"")
    while probe.stat().st_ctime_ns <= path.stat().st_ctime_ns:
        os.utime(probe)
    probe.unlink()


class FullDiskOS:
    """The os module, but renaming a file into place fails as on a full disk (monkeypatch it over a
    module's `os`)."""

    def __getattr__(self, name: str) -> object:
        return getattr(os, name)

    def replace(self, *args: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")
