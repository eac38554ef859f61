"""The browser edge (`edge-client serve --web-draft EXPORT_DIR`, page /edge/): the draft model of an ONNX
export runs in a headless Chromium tab on onnxruntime-web (WASM) and talks to the verifier over the
browser's own WebSocket. Its tokens are the verifier's `ar` tokens (greedy, seeded match, chat text),
the model files come from the page's origin once and from the browser's cache after, and a verifier
that does not allow the page's origin is named. The serving side's checks run everywhere; the page's
tests need Node 20 + npm (to build the bundle) and Chromium, and are skipped, saying why, without."""

from __future__ import annotations

import asyncio
import functools
import json
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import Request

from edge_client.cli import main as edge_cli
from edge_client.serve import create_app
from edge_client.web_edge import BUNDLE, WebEdge, WebEdgeError
from tests.clients.typescript_support import PROMPT, TS, _built, _seeded_ar, tiny_export
from tests.cloud_verifier.service import LiveServer, reference, slow_forwards
from tests.edge_client.browser import Browser, chromium
from tests.edge_client.local_server import served
from tests.edge_client.test_serve import _ar

__all__ = ["tiny_export"]  # a fixture, used by name


@functools.cache
def _bundle() -> str | None:
    """Build the browser bundle once; None when it worked, else why not."""
    why = _built()
    if why is not None:
        return why
    if chromium() is None:
        return "no chromium (apt-get install chromium): the browser edge's page tests are skipped"
    r = subprocess.run(
        [shutil.which("npm") or "npm", "run", "build:web"], cwd=TS, capture_output=True, text=True
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return None


@pytest.fixture
def bundle() -> Path:
    why = _bundle()
    if why is not None:
        pytest.skip(why)
    return BUNDLE


def _no_api() -> Any:
    raise AssertionError("the page's tests never use the local API")


@contextmanager
def _page_server(export: Path, verifier: str, bundle: Path) -> Iterator[str]:
    app = create_app(_no_api, web=WebEdge(export, verifier, bundle))
    with served(app) as port:
        yield f"http://127.0.0.1:{port}/edge/"


def _visit(b: Browser, url: str) -> dict[str, Any]:
    b.open(url)
    b.wait_for(f"location.href === {json.dumps(url)} && window.treespec && window.treespec.done", timeout=180)
    state: dict[str, Any] = json.loads(b.eval("JSON.stringify(window.treespec)"))
    marks = b.eval("JSON.stringify([...document.querySelectorAll('#out span')].map(s => s.className))")
    state["marks"] = json.loads(marks)
    return state


# ------------------------------------------------------------------ the serving side (no browser)
def _fake_bundle(root: Path) -> Path:
    for name in ("index.html", "edge-page.js", "treespec-edge.js", "ort/ort-wasm-simd-threaded.wasm"):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(b"<!doctype html>" if name.endswith(".html") else b"\0asm" + name.encode())
    return root


def test_the_endpoint_serves_the_bundle_and_the_export_and_nothing_else(
    tmp_path: Path, tiny_export: Path
) -> None:
    bundle = _fake_bundle(tmp_path / "web")
    (tmp_path / "secret.txt").write_text("not served")
    with (
        _page_server(tiny_export, "ws://127.0.0.1:9/v1/session", bundle) as page,
        httpx.Client(follow_redirects=True) as h,
    ):
        assert h.get(page).text == "<!doctype html>"
        assert h.get(page.removesuffix("/")).status_code == 200  # /edge redirects to /edge/
        conf = h.get(page + "config.json").json()
        assert conf == {"server": "ws://127.0.0.1:9/v1/session", "model": "model/"}
        wasm = h.get(page + "ort/ort-wasm-simd-threaded.wasm")
        assert wasm.headers["content-type"] == "application/wasm" and wasm.content.startswith(b"\0asm")
        manifest = h.get(page + "model/manifest.json")
        assert manifest.json()["fingerprint"] and manifest.headers["cache-control"] == "no-cache"
        onnx = h.head(page + "model/model.onnx")
        assert int(onnx.headers["content-length"]) == (tiny_export / "model.onnx").stat().st_size
        assert onnx.headers["cache-control"] == "no-cache" and onnx.headers["etag"]  # revalidated
        for bad in (
            "model/../../secret.txt",
            "ort/../../secret.txt",
            "model/nothing.onnx",
            "model/%2e%2e%2fsecret.txt",
        ):
            r = h.get(page + bad)
            assert r.status_code == 404 and "not served" not in r.text, bad


def test_a_missing_bundle_or_a_damaged_export_is_refused_at_start(tmp_path: Path, tiny_export: Path) -> None:
    with pytest.raises(WebEdgeError, match="make web"):
        WebEdge(tiny_export, "ws://127.0.0.1:9/v1/session", tmp_path / "nothing")
    bundle = _fake_bundle(tmp_path / "web")
    bad = tmp_path / "bad"
    shutil.copytree(tiny_export, bad)
    data = bad / "model.onnx.data"
    data.write_bytes(data.read_bytes()[:100])
    with pytest.raises(WebEdgeError, match=r"model\.onnx\.data"):
        WebEdge(bad, "ws://127.0.0.1:9/v1/session", bundle)
    with pytest.raises(WebEdgeError, match="not ws://"):
        WebEdge(tiny_export, "http://127.0.0.1:9", bundle)


def test_serve_refuses_web_draft_without_a_bundle(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        edge_cli(
            ["serve", "--web-draft", str(tmp_path), "--web-bundle", str(tmp_path / "none"), "--draft", "tiny"]
        )
    assert exc.value.code == 2
    assert "--web-draft" in capsys.readouterr().err


# ------------------------------------------------------------------ the page in Chromium
def test_the_page_drafts_in_the_tab_and_gives_the_verifiers_tokens(
    bundle: Path, tiny_export: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Greedy: the verifier's `ar` tokens, drafted tokens really accepted, pre-speculated trees taken
    (the verifier takes 100 ms a forward here, a sleep: on loopback `tiny` answers before a
    conditional tree drafted in the tab arrives); the model files fetched on the first visit and
    read from the browser's cache on the second; seeded match equals seeded ar; mode ar marks every
    token the target's."""
    slow_forwards(monkeypatch, 0.1)
    ids = ",".join(map(str, PROMPT))
    with LiveServer(allowed_origins="*") as srv, _page_server(tiny_export, srv.ws, bundle) as page:
        with Browser() as b:
            # (background=0: drafting from the first round; the other visits start while the model loads)
            first = _visit(b, f"{page}?prompt_ids={ids}&max=40&autorun=1&background=0")
            assert first["error"] is None, first["error"]
            assert first["tokens"] == reference(tuple(PROMPT), 40)
            kinds = {k for m in first["marks"] for k in m.split()}
            assert "model.onnx" in first["fetched"] and {"d1", "bonus", "hit"} <= kinds
            assert first["stats"]["tau"] > 1.0 and first["stats"]["hits"] > 0  # the page pre-speculates
            again = _visit(b, f"{page}?prompt_ids={ids}&max=40&autorun=1&prespec=0&background=0")
            assert again["tokens"] == first["tokens"] and again["stats"]["hits"] == 0
            assert again["fetched"] == ["manifest.json"] and "model.onnx" in again["cached"]
            match = _visit(b, f"{page}?prompt_ids={ids}&max=30&autorun=1&mode=match&temperature=0.9&seed=77")
            assert match["error"] is None and match["tokens"] == _seeded_ar(srv.ws)
            ar = _visit(b, f"{page}?prompt_ids={ids}&max=12&autorun=1&mode=ar&temperature=0")
            assert ar["tokens"] == reference(tuple(PROMPT), 12) and set(ar["marks"]) == {"target"}


def test_the_page_answers_before_its_model_is_loaded(
    bundle: Path, tiny_export: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The page's default start: the session opens once the manifest and tokenizer are read, and while
    model.onnx is still on its way (held back 2 s here) the rounds are the target's own tokens
    (marked "target", `cloudRounds`); once the model is loaded the tab drafts. The tokens are the
    verifier's `ar` tokens, and the first one came before the model was loaded."""
    slow_forwards(monkeypatch, 0.1)
    serve = WebEdge.model_file

    async def slow_model(self: WebEdge, name: str, request: Request) -> Any:
        if name == "model.onnx":
            await asyncio.sleep(2.0)
        return await serve(self, name, request)

    monkeypatch.setattr(WebEdge, "model_file", slow_model)
    ids = ",".join(map(str, PROMPT))
    with LiveServer(allowed_origins="*") as srv, _page_server(tiny_export, srv.ws, bundle) as page:
        with Browser() as b:
            got = _visit(b, f"{page}?prompt_ids={ids}&max=60&autorun=1&prespec=0")
    assert got["error"] is None, got["error"]
    assert got["tokens"] == reference(tuple(PROMPT), 60)
    marks, st = got["marks"], got["stats"]
    assert marks[:3] == ["target"] * 3 and st["cloudRounds"] >= 3, (marks, st)
    assert "d1" in {k for m in marks[st["cloudRounds"] :] for k in m.split()}  # drafted once loaded
    assert 0 < got["firstTokenPageMs"] < got["loadMs"], got


def test_the_page_tokenizes_a_chat_prompt_as_the_python_edge(bundle: Path, tiny_export: Path) -> None:
    """A text prompt goes through the export's tokenizer and chat template in the tab: the answer is
    the verifier's `ar` answer to the Python edge's ids for the same text."""
    from edge_client.onnx.export import read_manifest
    from edge_client.stored_tokenizer import StoredTokenizer

    m = read_manifest(tiny_export)
    tok = StoredTokenizer(tiny_export, bos_id=m.bos_id, eos_ids=m.eos_ids, chat_template=m.chat_template)
    msgs = [{"role": "user", "content": "Count to five, ünïcödé ✓."}]
    text = tok.render_chat(msgs, add_generation_prompt=True)
    want_ids = tok.encode(text, add_special=False, parse_special=True)
    with LiveServer(allowed_origins="*") as srv, _page_server(tiny_export, srv.ws, bundle) as page:
        want = _ar(srv.ws, want_ids, 24)
        with Browser() as b:
            got = _visit(
                b,
                f"{page}?prompt=Count%20to%20five%2C%20%C3%BCn%C3%AFc%C3%B6d%C3%A9%20%E2%9C%93.&max=24&autorun=1",
            )
    assert got["error"] is None and got["tokens"] == want


def test_a_verifier_that_refuses_the_pages_origin_is_named(bundle: Path, tiny_export: Path) -> None:
    with (
        LiveServer(allowed_origins="https://app.example") as srv,
        _page_server(tiny_export, srv.ws, bundle) as page,
    ):
        with Browser() as b:
            state = _visit(b, f"{page}?prompt_ids=1,2,3&max=4&autorun=1")
    assert state["error"] is not None and "origin" in state["error"], state["error"]


SDK_PAGE = """<!doctype html><meta charset="utf-8">
<script type="module">
  import * as ort from "/edge/ort/ort.wasm.min.mjs";
  import { Edge, webReader } from "/edge/treespec-edge.js";
  ort.env.wasm.wasmPaths = "/edge/ort/";
  ort.env.wasm.numThreads = 1;
  try {
    const opts = { prespec: true, tree: [1, 2, 1] };
    const edge = await Edge.open("SERVER", webReader("/edge/model/"), ort, opts);
    const ids = [];
    const gen = { maxNewTokens: 24, onVerdict: (v) => ids.push(...v.tokens) };
    for await (const _ of edge.generate(PROMPT, gen)) {}
    window.result = { ids, tau: edge.last.tau };
  } catch (e) { window.result = { error: String(e) }; }
</script>"""


def test_the_sdk_module_runs_in_a_page_without_a_bundler(
    bundle: Path, tiny_export: Path, tmp_path: Path
) -> None:
    """README's no-bundler example: a page imports the bundle's treespec-edge.js and onnxruntime-web's
    module from ort/, and its answer is the verifier's `ar` answer."""
    own = tmp_path / "web"
    shutil.copytree(bundle, own)
    with LiveServer(allowed_origins="*") as srv:
        page = SDK_PAGE.replace("SERVER", srv.ws).replace("PROMPT", json.dumps(PROMPT))
        (own / "sdk.html").write_text(page)
        with _page_server(tiny_export, srv.ws, own) as root, Browser() as b:
            b.open(root + "sdk.html")
            b.wait_for("window.result !== undefined", timeout=120)
            got = json.loads(b.eval("JSON.stringify(window.result)"))
    assert "error" not in got, got
    assert got["ids"] == reference(tuple(PROMPT), 24) and got["tau"] > 1.0
