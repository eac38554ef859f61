"""export-onnx and the ONNX drafter against malformed models: a malformed source GGUF is refused in
one line before torch loads anything, and nothing is written (no --out folder, no cache entry); a
cached export of such a file is refused rather than used; an export folder that onnxruntime cannot
load is refused in one line that says to export again. An export whose files are not the bytes its
manifest's checksums name (same-size garbage, a swapped file), or a cached export made from another
source (sha256) or in an earlier format, is never loaded: a folder the user named is refused in one
line naming the file, a cached export is made again with one log line saying why."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

pytest.importorskip("onnxruntime")
pytest.importorskip("onnx")

from edge_client.drafters.registry import create_drafter
from edge_client.onnx import export as onnx_export
from edge_client.onnx.export import (
    DATA_FILE,
    FORMAT,
    MANIFEST,
    MODEL_FILE,
    ExportError,
    cache_folder,
    ensure_export,
    read_manifest,
)
from shared import model_store
from shared.checksum import file_checksum
from shared.gguf_check import GGUFError
from tests.shared.gguf_files import MALFORMED

LIMITS = {"max_context": 64, "max_nodes": 8, "max_leaves": 4}


@pytest.mark.parametrize("name", ["no blocks", "2^32-1 blocks", "string of 2^62 bytes", "header only"])
def test_export_onnx_refuses_a_malformed_gguf_in_one_line_and_writes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], name: str
) -> None:
    """A 0-block GGUF used to be exported with exit 0 (an invalid graph), one declaring 2^32-1
    blocks allocated gigabytes, a string length of 2^62 gave a traceback."""
    import shared.model
    from edge_client.cli import main as cli_main

    def loaded(*args: object, **kwargs: object) -> None:
        raise AssertionError("a model was loaded from a malformed GGUF")

    monkeypatch.setattr(shared.model, "load_target", loaded)
    make, want = MALFORMED[name]
    path = make(tmp_path)
    out = tmp_path / "export"
    assert cli_main(["export-onnx", "--draft", str(path), "--out", str(out)]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"edge-client: export-onnx: {path}: "), lines
    assert want in lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]  # no --out, no scratch folder


def test_a_cached_export_of_a_malformed_gguf_is_refused_not_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, onnx_tiny_int8: Path
) -> None:
    """An export made on first use from a malformed GGUF (before the check existed) sits in the
    cache: using the GGUF through the cache refuses the file instead of loading that export."""
    monkeypatch.setenv("TREESPEC_CACHE", str(tmp_path / "cache"))
    make, want = MALFORMED["no blocks"]
    path = make(tmp_path)
    folder = cache_folder(str(path), True)
    shutil.copytree(onnx_tiny_int8, folder)
    manifest = json.loads((folder / MANIFEST).read_text())
    manifest["source_id"] = model_store.content_id(path)
    (folder / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(GGUFError, match=want):
        ensure_export(str(path), int8=True, progress=False)
    with pytest.raises(GGUFError, match=want):
        create_drafter("onnx", str(path), **LIMITS)


def test_an_export_onnxruntime_cannot_load_is_refused_in_one_line(tmp_path: Path, onnx_tiny: Path) -> None:
    """A graph onnxruntime refuses although its manifest vouches for it (e.g. exported from a
    malformed model): the checksums pass, onnxruntime's refusal is one line."""
    folder = tmp_path / "damaged"
    shutil.copytree(onnx_tiny, folder)
    graph = folder / MODEL_FILE
    graph.write_bytes(b"\0" * graph.stat().st_size)  # the size the manifest names, not a graph
    _vouch_for(folder, MODEL_FILE)
    with pytest.raises(ExportError) as info:
        create_drafter("onnx", str(folder), **LIMITS)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"{folder}: onnxruntime cannot load {MODEL_FILE} (")
    assert message.endswith("delete the folder and export again")


def _vouch_for(folder: Path, name: str) -> None:
    """Record `name`'s present checksum in the manifest (as if the export had written these bytes)."""
    raw = json.loads((folder / MANIFEST).read_text())
    raw["checksums"][name] = file_checksum(folder / name)
    (folder / MANIFEST).write_text(json.dumps(raw))


def _garble(path: Path) -> None:
    """Same-size garbage in the middle of `path`: its size still matches the manifest."""
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    data[mid : mid + 64] = bytes((b + 1) % 256 for b in data[mid : mid + 64])
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("name", [DATA_FILE, MODEL_FILE, "tokens.json"])
def test_same_size_garbage_in_a_named_export_is_refused_in_one_line_naming_the_file(
    tmp_path: Path, onnx_tiny: Path, name: str
) -> None:
    folder = tmp_path / "named"
    shutil.copytree(onnx_tiny, folder)
    _garble(folder / name)
    with pytest.raises(ExportError) as info:
        create_drafter("onnx", str(folder), **LIMITS)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"{folder / name} fails its checksum"), message
    assert message.endswith(f"export again with `edge-client export-onnx --draft tiny --out {folder}`")


def test_a_file_swapped_in_from_another_export_is_refused(
    tmp_path: Path, onnx_tiny: Path, onnx_tiny_int8: Path
) -> None:
    """The int8 export's tokenizer is the same bytes, its graph is not: a swapped graph of another
    export (with its own size recorded) is caught by the checksum, not loaded."""
    folder = tmp_path / "swapped"
    shutil.copytree(onnx_tiny, folder)
    shutil.copy(onnx_tiny_int8 / MODEL_FILE, folder / MODEL_FILE)
    raw = json.loads((folder / MANIFEST).read_text())
    raw["files"][MODEL_FILE] = (folder / MODEL_FILE).stat().st_size
    (folder / MANIFEST).write_text(json.dumps(raw))
    with pytest.raises(ExportError, match=f"{MODEL_FILE} fails its checksum"):
        read_manifest(folder)


def test_an_earlier_format_without_checksums_is_refused_in_one_line(tmp_path: Path, onnx_tiny: Path) -> None:
    folder = tmp_path / "old"
    shutil.copytree(onnx_tiny, folder)
    raw = json.loads((folder / MANIFEST).read_text())
    del raw["checksums"]
    (folder / MANIFEST).write_text(json.dumps({**raw, "format": 1}))
    with pytest.raises(ExportError, match=rf"export format 1, this version reads {FORMAT}; re-export"):
        create_drafter("onnx", str(folder), **LIMITS)
    (folder / MANIFEST).write_text(json.dumps(raw))  # the current format without checksums
    with pytest.raises(ExportError, match="'checksums' must name the files"):
        read_manifest(folder)


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, onnx_tiny: Path) -> list[Path]:
    """A scratch model cache whose exports copy the session's tiny export; the folders exported."""
    monkeypatch.setenv("TREESPEC_CACHE", str(tmp_path / "cache"))
    exported: list[Path] = []

    def fake_export(source: str, out: Path, **kw: object) -> object:
        exported.append(out)
        shutil.copytree(onnx_tiny, out)
        return read_manifest(out)

    monkeypatch.setattr(onnx_export, "export", fake_export)
    return exported


def _cached(onnx_tiny: Path) -> Path:
    folder = cache_folder("tiny", False)
    shutil.copytree(onnx_tiny, folder)
    return folder


def test_a_damaged_cached_export_is_made_again_with_one_log_line(
    onnx_tiny: Path, cache: list[Path], caplog: pytest.LogCaptureFixture
) -> None:
    folder = _cached(onnx_tiny)
    assert ensure_export("tiny", progress=False) == folder and cache == []  # sound: used as it is
    _garble(folder / DATA_FILE)
    with caplog.at_level("WARNING", logger="edge_client.onnx"):
        assert ensure_export("tiny", progress=False) == folder
    assert cache == [folder]
    assert (folder / DATA_FILE).read_bytes() == (onnx_tiny / DATA_FILE).read_bytes()
    [record] = caplog.records
    assert f"{folder / DATA_FILE} fails its checksum" in record.getMessage()
    assert record.getMessage().endswith("exporting it again")
    with create_drafter("onnx", "tiny", int8=False, export=False, **LIMITS) as d:
        assert d.vocab_size == read_manifest(onnx_tiny).vocab_size


def test_a_cached_export_of_another_source_sha256_is_made_again(
    onnx_tiny: Path, cache: list[Path], caplog: pytest.LogCaptureFixture
) -> None:
    folder = _cached(onnx_tiny)
    raw = json.loads((folder / MANIFEST).read_text())
    (folder / MANIFEST).write_text(json.dumps({**raw, "source_sha256": "0" * 64}))
    with pytest.raises(ExportError, match="exported from another model file"):
        create_drafter("onnx", "tiny", int8=False, export=False, **LIMITS)  # may not export: refused
    with caplog.at_level("WARNING", logger="edge_client.onnx"):
        assert ensure_export("tiny", progress=False) == folder
    assert cache == [folder] and len(caplog.records) == 1
    assert "exported from another model file (sha256 0000000000000000" in caplog.records[0].getMessage()
    assert read_manifest(folder).source_sha256 is None  # tiny has no file


def test_a_cached_export_of_an_earlier_format_is_made_again_and_removed(
    onnx_tiny: Path, cache: list[Path]
) -> None:
    folder = cache_folder("tiny", False)
    old = folder.with_name(folder.name.replace(f"-f{FORMAT}", "-f1"))
    shutil.copytree(onnx_tiny, old)
    assert ensure_export("tiny", progress=False) == folder
    assert cache == [folder] and not old.exists()
