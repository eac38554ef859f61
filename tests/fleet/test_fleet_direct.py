"""A replica's own address: the listening socket takes the next free port of a node's replicas, and
the listener serves the replica's app beside Serve's proxy (here, a bare app) until stopped."""

from __future__ import annotations

import asyncio
import ssl
import urllib.request
from pathlib import Path

import pytest
from fastapi import FastAPI

from bench.lib.procs import free_port
from cloud_verifier.fleet.config import DirectOptions
from cloud_verifier.fleet.direct import DirectListener, bind
from cloud_verifier.server_config import ServerConfig
from tests.cloud_verifier.test_tls import _self_signed


def test_replicas_of_one_node_take_the_next_free_ports() -> None:
    port = free_port()
    a = bind(DirectOptions(port=port, bind_host="127.0.0.1"))
    b = bind(DirectOptions(port=port, bind_host="127.0.0.1"))
    any_port = bind(DirectOptions(bind_host="127.0.0.1"))
    try:
        assert a.getsockname()[1] == port and b.getsockname()[1] == port + 1
        assert any_port.getsockname()[1] not in (0, port, port + 1)
    finally:
        for s in (a, b, any_port):
            s.close()


def test_the_listener_serves_the_app_at_the_address_it_advertises() -> None:
    app = FastAPI()

    @app.get("/healthz")
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    async def main() -> tuple[str, bytes, str]:
        listener = DirectListener(app, ServerConfig(), DirectOptions(bind_host="127.0.0.1"))
        await listener.start()
        url = listener.url("127.0.0.1")
        http = url.replace("ws://", "http://").replace("/v1/session", "/healthz")
        body = await asyncio.to_thread(lambda: urllib.request.urlopen(http, timeout=10).read())
        await listener.stop()
        try:
            await asyncio.to_thread(lambda: urllib.request.urlopen(http, timeout=2).read())
            after = "still served"
        except OSError:
            after = "refused"
        return url, body, after

    url, body, after = asyncio.run(main())
    assert url.startswith("ws://127.0.0.1:") and url.endswith("/v1/session")
    assert body == b'{"status":"ok"}' and after == "refused"
    named = DirectListener(
        FastAPI(), ServerConfig(), DirectOptions(bind_host="127.0.0.1", host="edge.example")
    )
    try:
        assert named.url("10.0.0.1") == f"ws://edge.example:{named.port}/v1/session"
    finally:
        asyncio.run(named.stop())


def test_with_a_certificate_the_listener_serves_wss(tmp_path: Path) -> None:
    cert, key = _self_signed(tmp_path)
    app = FastAPI()

    @app.get("/healthz")
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    options = DirectOptions(bind_host="127.0.0.1", host="localhost", ssl_certfile=cert, ssl_keyfile=key)

    async def main() -> tuple[str, bytes]:
        listener = DirectListener(app, ServerConfig(), options)
        await listener.start()
        url = listener.url("10.0.0.1")
        https = url.replace("wss://", "https://").replace("/v1/session", "/healthz")
        trust = ssl.create_default_context(cafile=cert)
        try:
            get = urllib.request.urlopen
            body = await asyncio.to_thread(lambda: get(https, timeout=10, context=trust).read())
        finally:
            await listener.stop()
        return url, body

    url, body = asyncio.run(main())
    assert url.startswith("wss://localhost:") and body == b'{"status":"ok"}'
    with pytest.raises(ValueError, match="go together"):
        DirectOptions(ssl_certfile=cert)
