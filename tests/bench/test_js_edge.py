"""bench.end_to_end.js_edge on the tiny model: the TypeScript and the Python edge, drafting with the same ONNX
export against one verifier, give the same output and a row each (skipped without Node 20 and npm)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.end_to_end import js_edge
from tests.clients.test_browser_edge import _bundle
from tests.clients.typescript_support import _built
from tests.edge_client.browser import chromium


@pytest.mark.slow  # a verifier process, four CLI runs and (with chromium) a browser: ~45 s
def test_both_edges_give_the_same_output(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    why = _built()
    if why is not None:
        pytest.skip(why)
    from edge_client.onnx import export as onnx_export

    folder = tmp_path / "tiny-onnx"
    onnx_export.export("tiny", folder, progress=False)
    monkeypatch.setattr(onnx_export, "ensure_export", lambda source, int8=False, progress=True: folder)
    out = tmp_path / "js_edge.json"
    edges = ["ts", "ts_prespec", "py"]
    if chromium() is not None and _bundle() is None:  # the browser page too, where it can run
        edges += ["chromium", "chromium_prespec"]
    args = ["--model", "tiny", "--draft", "tiny", "--humaneval", "1", "--prompts", "1", "--tokens", "12"]
    args += [
        "--edges",
        ",".join(edges),
        "--rtt-ms",
        "0",
        "--tree",
        "1,2,1",
        "--json",
        str(out),
        "--no-progress",
    ]
    assert js_edge.main(args) == 0
    doc = json.loads(out.read_text())
    assert doc["complete"] and [r["edge"] for r in doc["rows"]] == [js_edge.EDGES[e] for e in edges]
    assert all(r["identical_outputs"] == "2/2" and r["tau"] > 1.0 for r in doc["rows"])
    if "chromium" in edges:
        assert doc["rows"][-1]["first_token_s"] > 0
