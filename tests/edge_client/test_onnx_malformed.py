"""export-onnx and the ONNX drafter against malformed models: a malformed source GGUF is refused in
one line before torch loads anything, and nothing is written (no --out folder, no cache entry); a
cached export of such a file is refused rather than used; an export folder that onnxruntime cannot
load is refused in one line that says to export again."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

pytest.importorskip("onnxruntime")
pytest.importorskip("onnx")

from edge_client.drafters.registry import create_drafter
from edge_client.onnx.export import MANIFEST, MODEL_FILE, ExportError, cache_folder, ensure_export
from shared import model_store
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
    folder = tmp_path / "damaged"
    shutil.copytree(onnx_tiny, folder)
    graph = folder / MODEL_FILE
    graph.write_bytes(b"\0" * graph.stat().st_size)  # the size the manifest names, not a graph
    with pytest.raises(ExportError) as info:
        create_drafter("onnx", str(folder), **LIMITS)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"{folder}: onnxruntime cannot load {MODEL_FILE} (")
    assert message.endswith("delete the folder and export again")
