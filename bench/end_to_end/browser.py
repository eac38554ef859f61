"""A headless Chromium driven over its DevTools protocol: the pages' tests (the live view, the browser
edge) and bench.end_to_end.js_edge's Chromium edge. Debian's `chromium`; nothing is downloaded."""

from __future__ import annotations

import base64
import itertools
import json
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from bench.lib.procs import free_port


def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


class Browser:
    """`with Browser() as b: b.open(url); b.wait_for(js); b.eval(js); b.screenshot(path)`."""

    def __init__(self, width: int = 1200, height: int = 900, pin: Callable[[], None] | None = None) -> None:
        """pin: run in the browser's process before it starts (bench.harness.CoreSplit.pin_edge)."""
        exe = chromium()
        if exe is None:
            raise RuntimeError("no chromium: apt-get install chromium")
        self.port = free_port()
        self.profile = tempfile.mkdtemp(prefix="chromium-")
        self.proc = subprocess.Popen(
            [exe, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
             f"--remote-debugging-port={self.port}", f"--user-data-dir={self.profile}",
             f"--window-size={width},{height}", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=pin,
        )  # fmt: skip
        self._ids = itertools.count(1)
        self.ws: Any = None

    def __enter__(self) -> Browser:
        from websockets.sync.client import connect

        deadline = time.monotonic() + 30
        while True:
            try:
                pages = httpx.get(f"http://127.0.0.1:{self.port}/json", timeout=2).json()
                page = next(p for p in pages if p.get("type") == "page")
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        self._conn = connect(page["webSocketDebuggerUrl"], max_size=None)
        self.ws = self._conn.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.ws is not None:
            self._conn.__exit__(None, None, None)
        self.proc.kill()
        self.proc.wait()
        shutil.rmtree(self.profile, ignore_errors=True)

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        i = next(self._ids)
        self.ws.send(json.dumps({"id": i, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv(timeout=60))
            if msg.get("id") == i:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                result: dict[str, Any] = msg.get("result", {})
                return result

    def open(self, url: str) -> None:
        self.call("Page.enable")
        self.call("Page.navigate", url=url)

    def eval(self, expression: str) -> Any:
        r = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        return r.get("result", {}).get("value")

    def wait_for(self, expression: str, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while not self.eval(expression):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the page never satisfied {expression}")
            time.sleep(0.2)

    def screenshot(self, path: Path) -> None:
        data = self.call("Page.captureScreenshot", format="png")["data"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(data))
