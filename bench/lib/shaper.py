"""An emulated network link inside the client's process (EdgeClient(link=LinkShape...)): one-way
delay per direction, jitter that never reorders, a bandwidth cap. Tests and in-process benches use
it; benches can also put a real TCP delay proxy (bench.tools.netproxy, which uses DelayLine) between the
client and the verifier.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass

from edge_client.transports import Transport, TransportClosed


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

    def wrap(self, inner: Transport, seed: int = 0) -> Transport:
        """`inner` behind this link (edge_client.transports.Link)."""
        return ShapedTransport(inner, self, seed)


class DelayLine:
    """One direction of an emulated link: when each chunk sent now arrives.

    Chunks arrive in order, each no earlier than sent + serialization at the bandwidth cap + the
    one-way delay (+ uniform jitter, clamped so it never reorders the stream). Used by the
    in-process shaper here and by the TCP delay proxy (bench.tools.netproxy).
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


__all__ = ["DelayLine", "LinkShape", "ShapedTransport"]
