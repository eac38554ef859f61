"""A WebSocket echo app: what a proxy alone costs a frame's round trip (bench.serving.fleet's
overhead part). In a module of its own so that Serve's replicas import it by name (a class or
function pickled from `__main__` loses the globals its string annotations name, and FastAPI would
no longer see `ws` as the WebSocket)."""

from __future__ import annotations

from fastapi import FastAPI, WebSocket
from starlette.websockets import WebSocketDisconnect


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
