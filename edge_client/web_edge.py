"""The browser edge, served by `edge-client serve --web-draft EXPORT_DIR`: a page whose draft model runs
in the tab (onnxruntime-web, WASM) and talks to the verifier itself, over a WebSocket from the browser.

    /edge/              the page (clients/typescript/web/index.html, built into the static bundle)
    /edge/config.json   {"server": the verifier's URL, "model": "model/"}
    /edge/model/NAME    the export folder's files (manifest.json, model.onnx, its data, the tokenizer)
    /edge/PATH          the bundle's other files (the page's script, the SDK module, ort/*.wasm)

Nothing is fetched from a CDN: the runtime and the model come from this origin, and the page keeps the
model files in the browser's Cache Storage, so a second visit loads without the network. The verifier
must accept this page's Origin (`cloud-verifier serve --allowed-origins http://127.0.0.1:8080`).

Only files that exist when the endpoint starts are served (both folders are listed then), so no path
from a request ever reaches the file system.
"""

from __future__ import annotations

import json
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse, JSONResponse, RedirectResponse, Response

from edge_client.onnx.export import ExportError, read_manifest

BUNDLE = Path(__file__).resolve().parents[1] / "clients" / "typescript" / "dist" / "web"
BUNDLE_FILES = ("index.html", "edge-page.js", "treespec-edge.js", "ort/ort-wasm-simd-threaded.wasm")
MAX_FILES = 4096  # a bundle or export folder with more is not one
TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".mjs": "text/javascript; charset=utf-8",
    ".map": "application/json",
    ".json": "application/json",
    ".wasm": "application/wasm",
    ".txt": "text/plain; charset=utf-8",
}
# the page and its settings are asked again each visit; the rest may be kept a day (the page's own
# cache of the model files is keyed by the manifest, so a re-export is fetched again)
FRESH = {"index.html", "config.json", "manifest.json"}


class WebEdgeError(RuntimeError):
    """The bundle or the export folder cannot be served; the message says what to do."""


def _listing(folder: Path, recursive: bool) -> dict[str, Path]:
    files = folder.rglob("*") if recursive else folder.iterdir()
    out: dict[str, Path] = {}
    for p in files:
        if p.is_file() and not p.is_symlink():
            out[p.relative_to(folder).as_posix()] = p
            if len(out) > MAX_FILES:
                raise WebEdgeError(f"{folder}: more than {MAX_FILES} files; is this the right folder?")
    return out


class WebEdge:
    """The files of the browser edge: the static bundle and one export folder (both checked)."""

    def __init__(self, export_dir: Path, verifier_url: str, bundle_dir: Path = BUNDLE) -> None:
        missing = [f for f in BUNDLE_FILES if not (bundle_dir / f).is_file()]
        if missing:
            raise WebEdgeError(
                f"no browser bundle at {bundle_dir} (missing {', '.join(missing)}): build it with `make web` "
                "(Node 20 and npm), or give --web-bundle DIR"
            )
        try:
            self.manifest = read_manifest(export_dir)
        except ExportError as exc:
            raise WebEdgeError(str(exc)) from exc
        if not verifier_url.startswith(("ws://", "wss://")):
            raise WebEdgeError(f"the verifier URL {verifier_url!r} is not ws:// or wss://")
        self.bundle = _listing(bundle_dir, recursive=True)
        self.model = _listing(export_dir, recursive=False)
        self.config = {"server": verifier_url, "model": "model/"}

    def mount(self, app: FastAPI) -> None:
        # in this order: the catch-all of the bundle last
        for path, handler in (
            ("/edge", self.root),
            ("/edge/config.json", self.config_json),
            ("/edge/model/{name}", self.model_file),
            ("/edge/{path:path}", self.bundle_file),
        ):
            app.add_api_route(path, handler, methods=["GET", "HEAD"], include_in_schema=False)

    async def root(self) -> Response:
        return RedirectResponse("/edge/", status_code=308)

    async def config_json(self) -> Response:
        return JSONResponse(self.config, headers={"Cache-Control": "no-cache"})

    async def model_file(self, name: str) -> Response:
        return _file(self.model.get(name), name, "the export folder")

    async def bundle_file(self, path: str) -> Response:
        return _file(self.bundle.get(path or "index.html"), path, "the browser bundle")


def _file(path: Path | None, name: str, where: str) -> Response:
    if path is None:
        body = {"error": {"message": f"{name[:200]!r} is not in {where}", "type": "not_found", "code": None}}
        return Response(json.dumps(body), status_code=404, media_type="application/json")
    cache = "no-cache" if path.name in FRESH else "public, max-age=86400"
    media = TYPES.get(path.suffix, "application/octet-stream")
    return FileResponse(path, media_type=media, headers={"Cache-Control": cache})


__all__ = ["BUNDLE", "WebEdge", "WebEdgeError"]
