"""Byte transports under the client protocol: a WebSocket, and an in-process network shaper.

The shaper emulates a link in the client's process (one-way delay per direction, jitter that never
reorders, a bandwidth cap), which is what tests use; benches can also put a real TCP delay proxy
(`python -m bench.netproxy`) between the client and the verifier.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from dataclasses import dataclass
from typing import Protocol

from shared.errors import ErrorCode, ProtocolError


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
    ) -> WebSocketTransport:
        """Open `url` (ws:// or wss://). wss:// checks the server's certificate against the system's
        CAs, or against `ca_file` (PEM) when given (e.g. a private CA or a self-signed certificate).
        A peer that does not finish the closing handshake within `close_timeout` is cut off."""
        import ssl

        from websockets.asyncio.client import connect

        if not url.startswith(("ws://", "wss://")):
            raise ValueError(f"--server must be a full ws:// or wss:// URL, got {url!r}")
        if ca_file is not None and not url.startswith("wss://"):
            raise ValueError(f"a CA file is for wss:// URLs, got {url!r}")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
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
            raise _closed(exc) from exc

    async def recv(self) -> bytes:
        from websockets.exceptions import ConnectionClosed

        try:
            data = await self._ws.recv()  # type: ignore[attr-defined]
        except ConnectionClosed as exc:
            raise _closed(exc) from exc
        if not isinstance(data, bytes):
            raise ProtocolError(ErrorCode.BAD_FRAME, "a text frame (messages are binary frames)", "frame")
        return data

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self._ws.close()  # type: ignore[attr-defined]


def _closed(exc: Exception) -> TransportClosed:
    """The close that ended a `websockets` connection: the one this side sent when it closed first
    (1009 for a frame over max_size, 1002 for a protocol error), else the peer's."""
    rcvd, sent = getattr(exc, "rcvd", None), getattr(exc, "sent", None)
    if sent is not None and (rcvd is None or getattr(exc, "rcvd_then_sent", None) is False):
        return TransportClosed(sent.code, sent.reason, by_client=True)
    if rcvd is not None:
        return TransportClosed(rcvd.code, rcvd.reason)
    return TransportClosed(None, str(exc))


@dataclass(frozen=True)
class LinkShape:
    """One-way delays, jitter and bandwidth of an emulated link. RTT = up_ms + down_ms."""

    up_ms: float = 0.0
    down_ms: float = 0.0
    jitter_ms: float = 0.0
    bandwidth_mbps: float = 0.0  # 0: unlimited

    @classmethod
    def rtt(cls, rtt_ms: float, jitter_ms: float = 0.0, bandwidth_mbps: float = 0.0) -> LinkShape:
        return cls(rtt_ms / 2, rtt_ms / 2, jitter_ms, bandwidth_mbps)


class DelayLine:
    """One direction of an emulated link: when each chunk sent now arrives.

    Chunks arrive in order, each no earlier than sent + serialization at the bandwidth cap + the
    one-way delay (+ uniform jitter, clamped so it never reorders the stream). Used by the
    in-process shaper here and by the TCP delay proxy (bench.netproxy).
    """

    def __init__(self, delay_ms: float, jitter_ms: float, mbps: float, seed: int) -> None:
        self.delay = delay_ms / 1e3
        self.jitter = jitter_ms / 1e3
        self.bytes_per_s = mbps * 1e6 / 8 if mbps > 0 else 0.0
        self.rng = random.Random(seed)
        self.link_free = 0.0
        self.last_arrival = 0.0

    def arrival(self, n: int) -> float:
        now = time.monotonic()
        start = max(now, self.link_free)
        done = start + (n / self.bytes_per_s if self.bytes_per_s else 0.0)
        self.link_free = done
        at = done + self.delay + (self.rng.uniform(-self.jitter, self.jitter) if self.jitter else 0.0)
        at = max(at, self.last_arrival, now)  # jitter never reorders a stream
        self.last_arrival = at
        return at


class ShapedTransport:
    """Wraps a transport with an emulated link (for tests and in-process benches)."""

    def __init__(self, inner: Transport, shape: LinkShape, seed: int = 0) -> None:
        self.inner = inner
        self.shape = shape
        self._up = DelayLine(shape.up_ms, shape.jitter_ms, shape.bandwidth_mbps, seed)
        self._down = DelayLine(shape.down_ms, shape.jitter_ms, shape.bandwidth_mbps, seed + 1)
        self._out: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
        self._in: asyncio.Queue[tuple[float, bytes | TransportClosed]] = asyncio.Queue()
        self._head: tuple[float, bytes | TransportClosed] | None = None  # taken, not yet delivered
        self._tasks = [asyncio.create_task(self._pump_out()), asyncio.create_task(self._pump_in())]

    async def _pump_out(self) -> None:
        while True:
            at, data = await self._out.get()
            await _sleep_until(at)
            try:
                await self.inner.send(data)
            except TransportClosed:
                return

    async def _pump_in(self) -> None:
        while True:
            try:
                data: bytes | TransportClosed = await self.inner.recv()
            except TransportClosed as exc:
                data = exc
            n = len(data) if isinstance(data, bytes) else 0
            await self._in.put((self._down.arrival(n), data))
            if isinstance(data, TransportClosed):
                return

    async def send(self, data: bytes) -> None:
        await self._out.put((self._up.arrival(len(data)), data))

    async def recv(self) -> bytes:
        # cancel-safe: a frame taken off the queue stays at the head until it is delivered
        if self._head is None:
            self._head = await self._in.get()
        at, data = self._head
        await _sleep_until(at)
        if isinstance(data, TransportClosed):
            raise data  # the head stays: closed for later readers too
        self._head = None
        return data

    async def close(self) -> None:
        await asyncio.sleep(max(0.0, self._up.last_arrival - time.monotonic()))
        for t in self._tasks:
            t.cancel()
        await self.inner.close()


async def _sleep_until(at: float) -> None:
    delay = at - time.monotonic()
    if delay > 0:
        await asyncio.sleep(delay)
