"""The browser edge's files (`edge-client serve --web-draft EXPORT_DIR`, under /edge/): only the
bundle's web files and the files the export's manifest names are served; hidden files, files beside
the export and anything a manifest names outside its folder are not; a file gone since the start is a
404, not a 500; every answer says nosniff; files are revalidated (ETag, no-cache), so a re-export is
never served from a browser's HTTP cache under the old content. No model runs here: the export is a
manifest and small files of the sizes it names."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from edge_client.onnx.export import MANIFEST, Manifest
from edge_client.serve import create_app
from edge_client.web_edge import WebEdge, WebEdgeError
from shared.checksum import file_checksum

SERVER = "ws://127.0.0.1:9/v1/session"
BUNDLE_FILES = ("index.html", "edge-page.js", "treespec-edge.js", "ort/ort-wasm-simd-threaded.wasm")
EXPORT_FILES = {"model.onnx": b"graph", "model.onnx.data": b"weights" * 10, "tokenizer.json": b"{}"}

# a parent step, spelled so that the repository-paths check does not read it as this file's own
UP = ".." + "/"


def _manifest(files: object, checksums: object = None) -> dict[str, object]:
    m = Manifest(
        source="tiny", source_id="tiny", source_sha256=None, vocab_size=8, fingerprint="ab" * 16,
        int8=False, num_layers=1, num_kv_heads=1, head_dim=4, hidden_size=4, architecture="llama",
        bos_id=None, eos_ids=[0], chat_template=None, files={}, opset=17,
    )  # fmt: skip
    return {**asdict(m), "files": files, "checksums": checksums if checksums is not None else {}}


def _export(root: Path, files: dict[str, bytes] = EXPORT_FILES) -> Path:
    root.mkdir(parents=True)
    for name, data in files.items():
        (root / name).write_bytes(data)
    sums = {n: file_checksum(root / n) for n in files}
    (root / MANIFEST).write_text(json.dumps(_manifest({n: len(d) for n, d in files.items()}, sums)))
    return root


def _bundle(root: Path) -> Path:
    for name in BUNDLE_FILES:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(b"<!doctype html>" if name.endswith(".html") else name.encode())
    return root


def _no_api() -> Any:
    raise AssertionError("these tests never use the local API")


@pytest.fixture
def site(tmp_path: Path) -> Iterator[tuple[TestClient, Path, Path]]:
    export, bundle = _export(tmp_path / "export"), _bundle(tmp_path / "web")
    app = create_app(_no_api, web=WebEdge(export, SERVER, bundle))
    with TestClient(app, base_url="http://127.0.0.1:8080") as client:
        yield client, export, bundle


def _secrets(export: Path, bundle: Path) -> None:
    """What a careless user keeps beside the files (written before the endpoint starts)."""
    (bundle / ".env").write_text("API_KEY=sk-secret")
    (bundle / ".git").mkdir()
    (bundle / ".git" / "config.json").write_text('{"token": "secret"}')
    (bundle / "notes.md").write_text("secret")
    (bundle / "key.pem").write_text("secret")
    (export / ".hidden-key").write_text("secret")
    (export / "notes.txt").write_text("secret")


def test_only_the_bundles_web_files_and_the_manifests_files_are_served(tmp_path: Path) -> None:
    export, bundle = _export(tmp_path / "export"), _bundle(tmp_path / "web")
    _secrets(export, bundle)
    app = create_app(_no_api, web=WebEdge(export, SERVER, bundle))
    with TestClient(app, base_url="http://127.0.0.1:8080") as h:
        for name in BUNDLE_FILES:
            r = h.get(f"/edge/{name}")
            assert r.status_code == 200 and r.headers["x-content-type-options"] == "nosniff", name
        for name in (*EXPORT_FILES, MANIFEST):
            assert h.get(f"/edge/model/{name}").status_code == 200, name
        for bad in (
            ".env",
            ".git/config.json",
            "notes.md",
            "key.pem",
            "model/.hidden-key",
            "model/notes.txt",
        ):
            r = h.get(f"/edge/{bad}")
            assert r.status_code == 404 and "secret" not in r.text, bad
            assert r.headers["x-content-type-options"] == "nosniff"


def test_a_file_gone_since_the_start_is_a_404(site: tuple[TestClient, Path, Path]) -> None:
    h, export, bundle = site
    (export / "tokenizer.json").unlink()
    (bundle / "edge-page.js").unlink()
    for path in ("/edge/model/tokenizer.json", "/edge/edge-page.js"):
        r = h.get(path)
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found", path
    (export / "model.onnx").unlink()
    (export / "model.onnx").mkdir()  # not a file any more
    assert h.get("/edge/model/model.onnx").status_code == 404


def test_files_are_revalidated_so_a_re_export_is_fetched_again(site: tuple[TestClient, Path, Path]) -> None:
    h, export, _ = site
    first = h.get("/edge/model/model.onnx.data")
    assert first.headers["cache-control"] == "no-cache" and first.headers["etag"]
    same = h.get("/edge/model/model.onnx.data", headers={"If-None-Match": first.headers["etag"]})
    assert same.status_code == 304 and same.content == b""
    data = export / "model.onnx.data"
    data.unlink()
    data.write_bytes(b"WEIGHTS" * 10)  # re-exported: the same size, other content
    again = h.get("/edge/model/model.onnx.data", headers={"If-None-Match": first.headers["etag"]})
    assert again.status_code == 200 and again.content == b"WEIGHTS" * 10
    assert again.headers["etag"] != first.headers["etag"]
    for path in ("/edge/", "/edge/config.json", "/edge/ort/ort-wasm-simd-threaded.wasm"):
        r = h.get(path)
        assert "max-age" not in r.headers.get("cache-control", ""), path
        assert r.headers["x-content-type-options"] == "nosniff", path


@pytest.mark.parametrize("kind", ["list", "string", "null", "dotdot", "absolute", "hidden"])
def test_a_manifest_naming_anything_but_its_own_files_is_refused_at_start(tmp_path: Path, kind: str) -> None:
    export, bundle = _export(tmp_path / "export"), _bundle(tmp_path / "web")
    (export / ".hidden-key").write_text("secret")
    (tmp_path / "outside.txt").write_text("secret")  # sizes right: only the names are wrong
    sizes = {n: len(d) for n, d in EXPORT_FILES.items()}
    choices: dict[str, object] = {
        "list": [],
        "string": "model.onnx",
        "null": None,
        "dotdot": {**sizes, UP + "outside.txt": 6},
        "absolute": {**sizes, str(tmp_path / "outside.txt"): 6},
        "hidden": {**sizes, ".hidden-key": 6},
    }
    (export / MANIFEST).write_text(json.dumps(_manifest(choices[kind])))
    with pytest.raises(WebEdgeError, match="'files'"):
        WebEdge(export, SERVER, bundle)


@pytest.mark.parametrize("files", ["[]", '"model.onnx"', "null", '{"' + UP * 4 + 'etc/passwd": 1}'])
def test_serve_names_a_bad_web_draft_in_one_line(
    tmp_path: Path, files: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from edge_client.cli import main

    export, bundle = _export(tmp_path / "export"), _bundle(tmp_path / "web")
    raw = json.loads((export / MANIFEST).read_text())
    (export / MANIFEST).write_text(json.dumps({**raw, "files": json.loads(files)}))
    argv = ["serve", "--web-draft", str(export), "--web-bundle", str(bundle), "--draft", "/no/such.gguf"]
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "Traceback" not in err
    assert err.splitlines() == [err.strip()] and err.startswith("edge-client: --web-draft: "), err


def test_an_export_whose_files_fail_their_checksums_is_refused_at_start(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Same-size garbage in the weights (or a manifest from before checksums) never reaches a
    browser: `serve --web-draft` names the file in one line and says to export again."""
    from edge_client.cli import main

    export, bundle = _export(tmp_path / "export"), _bundle(tmp_path / "web")
    (export / "model.onnx.data").write_bytes(b"WEIGHTS" * 10)  # the size the manifest names
    with pytest.raises(WebEdgeError, match=r"model\.onnx\.data fails its checksum"):
        WebEdge(export, SERVER, bundle)
    argv = ["serve", "--web-draft", str(export), "--web-bundle", str(bundle), "--draft", "/no/such.gguf"]
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.splitlines() == [err.strip()], err
    assert f"{export / 'model.onnx.data'} fails its checksum" in err and "export again" in err
