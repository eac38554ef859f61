"""A WebSocket echo app and its measurement: what a proxy alone costs a frame's round trip, a
connect and an HTTP request (bench.serving.fleet's overhead part). The app is in a module of its
own so that Serve's replicas import it by name (a class or function pickled from `__main__` loses
the globals its string annotations name, and FastAPI would no longer see `ws` as the WebSocket)."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator

from fastapi import FastAPI, WebSocket
from starlette.websockets import WebSocketDisconnect

from bench.lib.procs import REPO, free_port


def echo_app() -> FastAPI:
    """`GET /healthz` and a WebSocket `/echo` that sends every binary frame back."""
    app = FastAPI()

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "alive"}

    @app.websocket("/echo")
    async def echo(ws: WebSocket) -> None:
        await ws.accept()
        try:
            while True:
                await ws.send_bytes(await ws.receive_bytes())
        except WebSocketDisconnect:
            pass

    return app


@contextlib.contextmanager
def echo_process() -> Iterator[str]:
    """The echo app on uvicorn in a process of its own (as a replica is); yields its HTTP base."""
    import httpx

    port = free_port()
    cmd = [sys.executable, "-m", "uvicorn", "bench.lib.echo:echo_app", "--factory", "--port", str(port),
           "--log-level", "warning"]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=REPO)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the echo app did not start")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(base + "/healthz").status_code == 200:
                    break
            time.sleep(0.1)
        yield base
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def echo_rounds(http: str, frames: int) -> tuple[float, list[float], list[float]]:
    """Against the echo app at `http`: seconds to connect its WebSocket, each 64-byte frame's round
    trip and each `GET /healthz` (`frames` of each; the first 5 of each left out as warm-up)."""
    import httpx
    from websockets.sync.client import connect

    t0 = time.perf_counter()
    with connect(http.replace("http://", "ws://") + "/echo") as ws:
        opened = time.perf_counter() - t0
        payload = b"x" * 64
        rtts = []
        for _ in range(frames):
            t = time.perf_counter()
            ws.send(payload)
            if ws.recv(30) != payload:
                raise RuntimeError("the echo app answered another frame")
            rtts.append(time.perf_counter() - t)
    gets = []
    with httpx.Client(base_url=http) as c:
        for _ in range(frames):
            t = time.perf_counter()
            c.get("/healthz").raise_for_status()
            gets.append(time.perf_counter() - t)
    return opened, rtts[5:], gets[5:]
