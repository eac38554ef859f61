"""A WebSocket echo app: the proxy's cost alone (`measure_proxy.py`). In a module of its own so
that Serve's replicas import it by name (a class or function pickled from `__main__` loses the
globals its string annotations name, and FastAPI would no longer see `ws` as the WebSocket)."""

from __future__ import annotations

from fastapi import FastAPI, WebSocket
from starlette.websockets import WebSocketDisconnect


def echo_app() -> FastAPI:
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
