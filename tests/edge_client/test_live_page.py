"""The live view of speculation (`edge-client serve`, page `/`) in a real headless Chromium: it
streams the answer with each token marked by how it came, the figures update, the text is exactly
the verifier's, and the cloud-only switch decodes target-only. Skipped without Chromium."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.cloud_verifier.service import LiveServer, tiny
from tests.edge_client.browser import Browser, chromium
from tests.edge_client.test_serve import _ar, edge_api

pytestmark = pytest.mark.skipif(chromium() is None, reason="no chromium (apt-get install chromium)")

SPANS = "JSON.stringify([...document.querySelectorAll('#out span')].map(s => [s.textContent, s.className]))"


def test_live_page_streams_marked_tokens_and_compares_with_cloud_only(tmp_path: Path) -> None:
    shot = Path(os.environ.get("TREESPEC_SCREENSHOT", tmp_path / "live.png"))
    with LiveServer() as srv, edge_api(srv.ws) as base, Browser() as b:
        root = base.removesuffix("/v1")
        b.open(f"{root}/?prompt=Count%20to%20five.&max=24&autorun=1")
        b.wait_for("document.getElementById('out').dataset.done === '1'")
        spans = json.loads(b.eval(SPANS))
        stats = b.eval("document.getElementById('stats').textContent")
        b.screenshot(shot)
        msgs = [{"role": "user", "content": "Count to five."}]
        ids = tiny().tokenizer.encode(tiny().tokenizer.apply_chat_template(msgs), add_special=False)
        want = _ar(srv.ws, ids, 24)
        text = tiny().tokenizer.decode([t for t in want if t not in tiny().eos_ids], skip_special=True)
        assert "".join(t for t, _ in spans).replace("\ufffd", "") == text.replace("\ufffd", "")
        kinds = {c.split()[0] for _, c in spans}
        assert "d1" in kinds and "bonus" in kinds  # accepted draft tokens and the target's own
        assert "τ" in stats and "rounds" in stats
        # the cloud-only switch: the same text, every token the target's
        b.open(f"{root}/?prompt=Count%20to%20five.&max=24&autorun=1&cloud=1")
        b.wait_for("document.getElementById('out').dataset.done === '1'")
        spans2 = json.loads(b.eval(SPANS))
        assert {c for _, c in spans2} == {"target"}
        assert "".join(t for t, _ in spans2).replace("\ufffd", "") == text.replace("\ufffd", "")
    assert shot.stat().st_size > 10_000
