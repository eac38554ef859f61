"""`edge-client export-onnx --out DIR` replaces only what an export wrote: a missing or empty folder
or an earlier export (its manifest and the files that names). Anything else, `.`, `..`, the working
folder, a file or a link, is refused in one line before any work, and nothing of it is removed. A
manifest that names anything but plain files of its own folder is refused wherever it is read."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from edge_client.cli import main as cli_main
from edge_client.onnx.export import (
    MANIFEST,
    ExportError,
    OutFolderError,
    check_out_folder,
    export,
    read_manifest,
)

# a parent step, spelled so that the repository-paths check does not read it as this file's own
UP = ".." + "/"


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize("extra", ["thesis.txt", ".hidden", "sub/"])
def test_a_folder_holding_anything_besides_an_export_is_refused_and_kept(
    onnx_tiny: Path, tmp_path: Path, extra: str
) -> None:
    user = tmp_path / "user"
    user.mkdir()
    (user / "thesis.txt").write_text("three years of work")
    with pytest.raises(OutFolderError, match="not an ONNX export"):
        export("tiny", user, progress=False)
    assert (user / "thesis.txt").read_text() == "three years of work"

    mixed = _copy(onnx_tiny, tmp_path / "mixed")  # an export someone put a file into
    if extra.endswith("/"):
        (mixed / extra).mkdir()
    else:
        (mixed / extra).write_text("keep me")
    before = sorted(p.name for p in mixed.iterdir())
    with pytest.raises(OutFolderError, match=extra.rstrip("/")):
        export("tiny", mixed, progress=False)
    assert sorted(p.name for p in mixed.iterdir()) == before
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no scratch folder left


def test_a_folder_whose_manifest_is_not_an_exports_is_refused(tmp_path: Path) -> None:
    web = tmp_path / "web-app"
    web.mkdir()
    (web / MANIFEST).write_text(json.dumps({"name": "My PWA", "icons": []}))  # a web app's manifest
    with pytest.raises(OutFolderError, match="not an export's manifest"):
        check_out_folder(web)
    assert (web / MANIFEST).is_file()


@pytest.mark.parametrize("name", [".", "..", "", "./", "sub/.."])
def test_the_working_folder_and_above_are_refused(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    here = tmp_path / "a" / "b"
    (here / "sub").mkdir(parents=True)
    (here / "notes.txt").write_text("mine")
    monkeypatch.chdir(here)
    with pytest.raises(OutFolderError, match="working folder or above"):
        check_out_folder(Path(name))
    with pytest.raises(OutFolderError):
        check_out_folder(here.resolve())
    with pytest.raises(OutFolderError):
        check_out_folder(tmp_path)
    if name:
        assert cli_main(["export-onnx", "--draft", "tiny", "--out", name]) == 2
        err = capsys.readouterr().err
        lines = err.splitlines()
        assert len(lines) == 1 and lines[0].startswith("edge-client: export-onnx: --out: "), err
    assert (here / "notes.txt").read_text() == "mine" and (here / "sub").is_dir()


def test_a_file_or_a_link_is_refused(onnx_tiny: Path, tmp_path: Path) -> None:
    f = tmp_path / "thesis.txt"
    f.write_text("mine")
    with pytest.raises(OutFolderError, match="is a file"):
        check_out_folder(f)
    link = tmp_path / "link"
    link.symlink_to(_copy(onnx_tiny, tmp_path / "real"))
    with pytest.raises(OutFolderError, match="is a link"):
        check_out_folder(link)
    assert f.read_text() == "mine" and (tmp_path / "real" / MANIFEST).is_file()


def test_an_empty_folder_or_an_earlier_export_is_replaced_with_the_usual_permissions(
    onnx_tiny: Path, tmp_path: Path
) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    check_out_folder(empty)
    check_out_folder(tmp_path / "missing")
    earlier = _copy(onnx_tiny, tmp_path / "earlier")
    (earlier / "model.onnx.data").write_bytes(b"\0" * 16)  # damaged: still an export, still replaced
    export("tiny", earlier, progress=False)
    assert read_manifest(earlier).source == "tiny"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["earlier", "empty"]  # nothing aside is left
    umask = os.umask(0)
    os.umask(umask)
    assert earlier.stat().st_mode & 0o777 == 0o777 & ~umask  # as mkdir makes it, not mkdtemp's 0700


def _bad_files(kind: str, real: dict[str, int], folder: Path) -> object:
    """manifest `files` of one bad kind; a name outside the folder names a file that exists there,
    with its size, so that only the name is wrong."""
    outside = folder.parent / "outside.txt"
    outside.write_text("secret")
    (folder / ".hidden-key").write_text("secret")
    (folder / "sub").mkdir()
    (folder / "sub" / "x.bin").write_text("secret")
    bad: dict[str, object] = {
        "list": [],
        "string": "model.onnx",
        "null": None,
        "empty": {},
        "dotdot": {**real, UP + "outside.txt": 6},
        "absolute": {**real, str(outside): 6},
        "hidden": {**real, ".hidden-key": 6},
        "subfolder": {**real, "sub/x.bin": 6},
        "size": {**real, "model.onnx": str(real["model.onnx"])},
    }
    return bad[kind]


@pytest.mark.parametrize(
    "kind", ["list", "string", "null", "empty", "dotdot", "absolute", "hidden", "subfolder", "size"]
)
def test_a_manifest_naming_anything_but_its_own_plain_files_is_refused(
    onnx_tiny: Path, tmp_path: Path, kind: str
) -> None:
    bad = _copy(onnx_tiny, tmp_path / "bad")
    raw = json.loads((bad / MANIFEST).read_text())
    raw["files"] = _bad_files(kind, raw["files"], bad)
    (bad / MANIFEST).write_text(json.dumps(raw))
    with pytest.raises(ExportError, match="'files'"):
        read_manifest(bad)


@pytest.mark.parametrize(
    ("key", "value"), [("vocab_size", "49152"), ("eos_ids", None), ("int8", 1), ("num_layers", 0)]
)
def test_a_manifest_field_of_the_wrong_type_is_refused(
    onnx_tiny: Path, tmp_path: Path, key: str, value: object
) -> None:
    bad = _copy(onnx_tiny, tmp_path / "bad")
    raw = json.loads((bad / MANIFEST).read_text())
    raw[key] = value
    (bad / MANIFEST).write_text(json.dumps(raw))
    with pytest.raises(ExportError, match=key):
        read_manifest(bad)
    (bad / MANIFEST).write_text("[1, 2]")
    with pytest.raises(ExportError, match="not a JSON object"):
        read_manifest(bad)


def test_an_interrupted_export_is_130_in_one_line_and_leaves_the_earlier_export(
    onnx_tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from edge_client.onnx import graph

    def ctrl_c(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(graph, "write_model", ctrl_c)
    earlier = _copy(onnx_tiny, tmp_path / "earlier")
    before = {p.name: p.stat().st_size for p in earlier.iterdir()}
    try:
        rc = cli_main(["export-onnx", "--draft", "tiny", "--out", str(earlier)])
    except KeyboardInterrupt:
        pytest.fail("the interrupt escaped main() (a traceback for the user)")
    err = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("export-onnx: ")]
    assert rc == 130 and err == ["edge-client: interrupted"], err
    assert {p.name: p.stat().st_size for p in earlier.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["earlier"]  # no scratch folder left
