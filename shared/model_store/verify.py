"""Checking model files: sha256, the stamp beside a verified file, content ids, the fetch lock."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

from shared.model_store.catalog import FILES, ModelFile, ModelStoreError
from shared.model_store.paths import cache_dir, installed_copy, models_dir

_CHUNK = 8 << 20  # bytes per read while hashing


def file_sha256(path: Path, progress: bool = False, desc: str = "checking") -> str:
    from tqdm import tqdm

    digest = hashlib.sha256()
    with (
        path.open("rb") as f,
        tqdm(
            total=path.stat().st_size,
            unit="B",
            unit_scale=True,
            desc=f"{desc} {path.name}",
            disable=not progress,
        ) as bar,
    ):
        while block := f.read(_CHUNK):
            digest.update(block)
            bar.update(len(block))
    return digest.hexdigest()


def _stamp_path(path: Path) -> Path:
    return path.with_name(path.name + ".verified")


def write_stamp(path: Path, sha256: str) -> None:
    st = path.stat()
    stamp = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha256}
    tmp = _stamp_path(path).with_suffix(".tmp")
    tmp.write_text(json.dumps(stamp))
    os.replace(tmp, _stamp_path(path))


def stamp_ok(mf: ModelFile, path: Path) -> bool:
    """True when `path` was verified and has not changed since (size, mtime)."""
    if not mf.verifiable:
        return True
    try:
        stamp = json.loads(_stamp_path(path).read_text())
        st = path.stat()
    except (OSError, ValueError):
        return False
    return bool(
        stamp.get("size") == st.st_size == mf.size
        and stamp.get("mtime_ns") == st.st_mtime_ns
        and stamp.get("sha256") == mf.sha256
    )


def check_file(mf: ModelFile, path: Path, progress: bool = True) -> None:
    """Hash `path`; a file that is not `mf` raises with what to do (and is never used)."""
    size = path.stat().st_size
    if size != mf.size:
        raise ModelStoreError(
            f"{path} is {size} bytes, expected {mf.size}: it is damaged or another file. Delete it "
            "and fetch again (`python -m shared.model_store fetch` or `make models`)."
        )
    sha = file_sha256(path, progress)
    if sha != mf.sha256:
        raise ModelStoreError(
            f"{path} has sha256 {sha}, expected {mf.sha256}: it is damaged or another file. Delete it "
            "and fetch again (`python -m shared.model_store fetch` or `make models`)."
        )
    if path.parent == models_dir():
        write_stamp(path, sha)


def content_id(path: Path) -> str:
    """A short id of a model file's content for keys of derived caches: the recorded sha256 when
    the file is one of the store's (verified), else a hash of its path, size and mtime."""
    for mf in FILES.values():
        if mf.filename == path.name and mf.verifiable and path.stat().st_size == mf.size:
            if installed_copy(mf) == path or stamp_ok(mf, path):
                return mf.sha256[:16]
    st = path.stat()
    key = f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}"
    return "p" + hashlib.sha256(key.encode()).hexdigest()[:15]


def content_sha256(path: Path, progress: bool = False) -> str:
    """The sha256 of a model file's content, for caches that must never serve another file's data:
    the recorded one of a verified store file, else hashed once and kept in `<cache>/sha256/` under
    the file's (path, size, mtime_ns, ctime_ns, inode). A file replaced or rewritten since changes
    one of those (its ctime even when its mtime is set back) and is hashed again; what a stale key
    could still miss, the derived cache's own checksum of its data catches."""
    for mf in FILES.values():
        if mf.filename == path.name and mf.verifiable and path.stat().st_size == mf.size:
            if installed_copy(mf) == path or stamp_ok(mf, path):
                return mf.sha256
    st = path.stat()
    where = str(path.resolve())
    key = {
        "path": where,
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "ctime_ns": st.st_ctime_ns,
        "inode": st.st_ino,
    }
    memo = cache_dir() / "sha256" / f"{hashlib.sha256(where.encode()).hexdigest()[:32]}.json"
    with contextlib.suppress(OSError, ValueError, AttributeError):
        saved = json.loads(memo.read_text(encoding="utf-8"))
        sha = saved.get("sha256")
        if {k: saved.get(k) for k in key} == key and isinstance(sha, str) and len(sha) == 64:
            return sha
    sha = file_sha256(path, progress, "hashing")
    with contextlib.suppress(OSError):  # unwritable: the file is hashed again next time
        memo.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({**key, "sha256": sha}), encoding="utf-8")
        os.replace(tmp, memo)
    return sha


@contextlib.contextmanager
def locked(dst: Path) -> Iterator[None]:
    lock = dst.with_name(f".{dst.name}.lock")
    with lock.open("w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
