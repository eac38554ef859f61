"""A replica's own address: a second listener of its app, past the fleet's proxy.

Every frame of a session through Serve's proxy costs the proxy's process ~2 ms of CPU a round trip,
which a small target's round cannot hide, and the proxy's CPU is shared with the replicas'. With
`direct` on, each replica also listens on a port of its own (`DirectListener`) and offers that
address to a client whose hello asks (welcome.direct, PROTOCOL.md section 3): the client moves its
session there before the first prompt, and the connection through the proxy stays open, idle, until
the session ends. Serve's proxy still routes each new session (least loaded, a resume to its KV
holder) and still counts every session by its idle connection (the session cap, autoscaling, a
replica's drain), while the rounds go straight to the replica. A client that cannot reach the
address (another network) stays on the proxy.

The listener binds `bind_host` on `port` or, taken, the next free one of PORT_TRIES (0: a port the
system picks), and advertises `host` (default: the IP of the replica's Ray node). With a certificate
(`DirectOptions.ssl_certfile`) it serves wss://; a fleet whose proxy serves TLS gives its replicas
one, because a client on wss:// never moves its session to a ws:// address (the API key would cross
the network in the clear).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Iterator
from dataclasses import replace

import uvicorn
from fastapi import FastAPI

from cloud_verifier.fleet.config import DirectOptions
from cloud_verifier.server_config import ServerConfig

log = logging.getLogger("cloud_verifier.fleet")

PORT_TRIES = 64  # ports tried from a fixed one upwards (replicas of one node each take one)
SESSION_PATH = "/v1/session"


class _Server(uvicorn.Server):
    """uvicorn's server without its signal handlers (the replica's process has its own)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def bind(options: DirectOptions) -> socket.socket:
    """A listening socket on the options' interface and port (or the next free one)."""
    ports = [0] if options.port == 0 else range(options.port, min(options.port + PORT_TRIES, 65536))
    last: OSError | None = None
    for port in ports:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((options.bind_host, port))
        except OSError as exc:
            sock.close()
            last = exc
            continue
        sock.listen(2048)
        sock.setblocking(False)
        return sock
    raise OSError(f"no free port for the replica's own address from {options.port}: {last}")


class DirectListener:
    """The replica's app on a socket of its own (`start`, then `url`; `stop`)."""

    def __init__(self, app: FastAPI, config: ServerConfig, options: DirectOptions) -> None:
        from cloud_verifier.server import uvicorn_config

        self.options = options
        self._sock = bind(options)
        port = self._sock.getsockname()[1]
        tls = replace(config, ssl_certfile=options.ssl_certfile, ssl_keyfile=options.ssl_keyfile)
        uv = uvicorn_config(app, tls, options.bind_host, port, "warning", lifespan="off")
        self._server = _Server(uv)
        self._task: asyncio.Task[None] | None = None
        self.port: int = port

    def url(self, node_ip: str) -> str:
        """The address a client reaches this listener by."""
        scheme = "wss" if self.options.tls else "ws"
        return f"{scheme}://{self.options.host or node_ip}:{self.port}{SESSION_PATH}"

    async def start(self) -> None:
        """Serve on the socket (returns once it accepts connections)."""
        self._task = asyncio.create_task(self._server.serve(sockets=[self._sock]))
        while not self._server.started:
            if self._task.done():  # (it failed: its error)
                await self._task
                raise RuntimeError("the replica's own listener stopped at start-up")
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        """Stop listening; its connections get uvicorn's graceful shutdown."""
        self._server.should_exit = True
        if self._task is not None:
            with contextlib.suppress(Exception):
                await self._task
        self._sock.close()
