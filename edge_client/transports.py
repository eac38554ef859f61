"""The byte transports under the edge's session (edge_client.session): a WebSocket carrying binary
frames, and what any transport offers (`Transport`). A `Link` wraps a transport in an emulated
network link (bench.shaper.LinkShape, for tests and in-process benches).
"""

from __future__ import annotations

import contextlib
from typing import Protocol

from shared.errors import ErrorCode, ProtocolError
from shared.handshake import SESSION_HEADER


class TransportClosed(Exception):
    """The connection ended; `code` and `reason` are the WebSocket close code and reason if known,
    `by_client` whether this side closed it (e.g. 1009: the peer sent a frame over max_size)."""

    def __init__(self, code: int | None = None, reason: str = "", by_client: bool = False) -> None:
        super().__init__(f"connection closed ({code}): {reason}" if code is not None else "connection closed")
        self.code = code
        self.reason = reason
        self.by_client = by_client


class Transport(Protocol):
    async def send(self, data: bytes) -> None: ...

    async def recv(self) -> bytes: ...

    async def close(self) -> None: ...


class Link(Protocol):
    """Something put between the session and its transport, e.g. an emulated network link
    (bench.shaper.LinkShape): `wrap` returns the transport the session then uses."""

    def wrap(self, inner: Transport) -> Transport: ...


class WebSocketTransport:
    """A `websockets` client connection carrying binary frames."""

    def __init__(self, ws: object) -> None:
        self._ws = ws

    @classmethod
    async def connect(
        cls,
        url: str,
        api_key: str | None = None,
        max_size: int = 1 << 22,
        open_timeout: float = 30.0,
        ca_file: str | None = None,
        close_timeout: float = 5.0,
        session_id: str | None = None,
    ) -> WebSocketTransport:
        """Open `url` (ws:// or wss://). wss:// checks the server's certificate against the system's
        CAs, or against `ca_file` (PEM) when given (e.g. a private CA or a self-signed certificate).
        A peer that does not finish the closing handshake within `close_timeout` is cut off.
        `session_id`: the resume token of the session this connection resumes, in the
        `X-Session-Id` header, by which a fleet's router finds the replica that holds it."""
        import ssl

        from websockets.asyncio.client import connect

        if not url.startswith(("ws://", "wss://")):
            raise ValueError(f"--server must be a full ws:// or wss:// URL, got {url!r}")
        if ca_file is not None and not url.startswith("wss://"):
            raise ValueError(f"a CA file is for wss:// URLs, got {url!r}")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        if session_id:
            headers[SESSION_HEADER] = session_id
        tls = ssl.create_default_context(cafile=ca_file) if url.startswith("wss://") else None
        ws = await connect(
            url,
            additional_headers=headers,
            max_size=max_size,
            open_timeout=open_timeout,
            close_timeout=close_timeout,
            compression=None,
            ssl=tls,
        )
        return cls(ws)

    async def send(self, data: bytes) -> None:
        from websockets.exceptions import ConnectionClosed

        try:
            await self._ws.send(data)  # type: ignore[attr-defined]
        except ConnectionClosed as exc:
            raise _transport_closed(exc) from exc

    async def recv(self) -> bytes:
        from websockets.exceptions import ConnectionClosed

        try:
            data = await self._ws.recv()  # type: ignore[attr-defined]
        except ConnectionClosed as exc:
            raise _transport_closed(exc) from exc
        if not isinstance(data, bytes):
            raise ProtocolError(ErrorCode.BAD_FRAME, "a text frame (messages are binary frames)", "frame")
        return data

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self._ws.close()  # type: ignore[attr-defined]


def _transport_closed(exc: Exception) -> TransportClosed:
    """The close that ended a `websockets` connection: the one this side sent when it closed first
    (1009 for a frame over max_size, 1002 for a protocol error), else the peer's."""
    rcvd, sent = getattr(exc, "rcvd", None), getattr(exc, "sent", None)
    if sent is not None and (rcvd is None or getattr(exc, "rcvd_then_sent", None) is False):
        return TransportClosed(sent.code, sent.reason, by_client=True)
    if rcvd is not None:
        return TransportClosed(rcvd.code, rcvd.reason)
    return TransportClosed(None, str(exc))


__all__ = ["Link", "Transport", "TransportClosed", "WebSocketTransport"]
