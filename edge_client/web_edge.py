"""The browser edge, served by `edge-client serve --web-draft EXPORT_DIR`: a page whose draft model runs
in the tab (onnxruntime-web, WASM) and talks to the verifier itself, over a WebSocket from the browser.

    /edge/              the page (clients/typescript/web/index.html, built into the static bundle)
    /edge/config.json   {"server": the verifier's URL, "model": "model/"}
    /edge/model/NAME    the export folder's files (manifest.json, model.onnx, its data, the tokenizer)
    /edge/PATH          the bundle's other files (the page's script, the SDK module, ort/*.wasm)

Nothing is fetched from a CDN: the runtime and the model come from this origin, and the page keeps the
model files in the browser's Cache Storage, so a second visit loads without the network. The verifier
must accept this page's Origin (`cloud-verifier serve --allowed-origins http://127.0.0.1:8080`).

Only the files listed when the endpoint starts are served, so no path from a request ever reaches the
file system: of the bundle, its web files (TYPES) outside hidden folders and not hidden themselves; of
the export, manifest.json and the plain file names it lists. A listed file that is gone is a 404. Every
answer says `X-Content-Type-Options: nosniff`; files carry an ETag and `Cache-Control: no-cache`, so a
browser asks again each visit (a 304 when unchanged) and never keeps a re-exported model or a rebuilt
bundle under the old content.
"""

from __future__ import annotations

import json
import stat
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, RedirectResponse, Response

from edge_client.onnx.export import MANIFEST, ExportError, read_manifest

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
NOSNIFF = {"X-Content-Type-Options": "nosniff"}


class WebEdgeError(RuntimeError):
    """The bundle or the export folder cannot be served; the message says what to do."""


def _bundle_files(folder: Path) -> dict[str, Path]:
    """The bundle's web files by URL path: a suffix of TYPES, no hidden part, not a link."""
    out: dict[str, Path] = {}
    for p in folder.rglob("*"):
        rel = p.relative_to(folder)
        hidden = any(part.startswith(".") for part in rel.parts)
        if not hidden and p.suffix in TYPES and p.is_file() and not p.is_symlink():
            out[rel.as_posix()] = p
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
        self.bundle = _bundle_files(bundle_dir)
        # read_manifest admits plain file names only: nothing outside the folder, nothing hidden
        self.model = {name: export_dir / name for name in (MANIFEST, *self.manifest.files)}
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
        return RedirectResponse("/edge/", status_code=308, headers=NOSNIFF)

    async def config_json(self) -> Response:
        return JSONResponse(self.config, headers={"Cache-Control": "no-cache", **NOSNIFF})

    async def model_file(self, name: str, request: Request) -> Response:
        return _file(self.model.get(name), name, "the export folder", request)

    async def bundle_file(self, path: str, request: Request) -> Response:
        return _file(self.bundle.get(path or "index.html"), path, "the browser bundle", request)


def _file(path: Path | None, name: str, where: str, request: Request) -> Response:
    """The file at `path` (404 when None or gone), or a 304 when the browser's copy is current."""
    try:
        st = path.stat() if path is not None else None
    except OSError:
        st = None
    if path is None or st is None or not stat.S_ISREG(st.st_mode):
        body = {"error": {"message": f"{name[:200]!r} is not in {where}", "type": "not_found", "code": None}}
        return Response(json.dumps(body), status_code=404, media_type="application/json", headers=NOSNIFF)
    etag = f'"{st.st_size:x}-{st.st_mtime_ns:x}-{st.st_ino:x}"'
    headers = {"Cache-Control": "no-cache", "ETag": etag, **NOSNIFF}
    if etag in [t.strip() for t in request.headers.get("if-none-match", "").split(",")]:
        return Response(status_code=304, headers=headers)
    media = TYPES.get(path.suffix, "application/octet-stream")
    return FileResponse(path, media_type=media, headers=headers, stat_result=st)


__all__ = ["BUNDLE", "WebEdge", "WebEdgeError"]
