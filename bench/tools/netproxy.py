"""A TCP delay proxy: a real network hop between the edge client and the verifier.

The kernel's `tc netem` is not available on these machines (no netem qdisc module), so benches
put this proxy, run as a separate process, on the path: every chunk read from one side is written to
the other no earlier than `delay` (+ uniform jitter that never reorders the stream) after it was
read, and no faster than the bandwidth cap allows.

    python -m bench netproxy --listen 127.0.0.1:9000 --target 127.0.0.1:8000 --delay-ms 25
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import signal
import sys
import time
from collections.abc import Sequence

from bench.lib.shaper import DelayLine


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, d: DelayLine) -> None:
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    async def deliver() -> None:
        while True:
            at, chunk = await queue.get()
            wait = at - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            if not chunk:
                with contextlib.suppress(Exception):
                    writer.write_eof()
                return
            writer.write(chunk)
            await writer.drain()

    task = asyncio.create_task(deliver())
    try:
        while True:
            chunk = await reader.read(1 << 16)
            await queue.put((d.arrival(len(chunk)), chunk))
            if not chunk:
                break
        await task
    except (ConnectionError, asyncio.CancelledError):
        task.cancel()
    finally:
        with contextlib.suppress(Exception):
            writer.close()


async def run_proxy(
    listen: tuple[str, int],
    target: tuple[str, int],
    up_ms: float,
    down_ms: float,
    jitter_ms: float,
    mbps: float,
    ready: asyncio.Event | None = None,
) -> None:
    rng = random.Random(0)

    async def handle(c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        try:
            s_reader, s_writer = await asyncio.open_connection(*target)
        except OSError:
            c_writer.close()
            return
        # TCP_NODELAY: small frames must not wait for Nagle on top of the emulated delay
        for w in (c_writer, s_writer):
            sock = w.get_extra_info("socket")
            if sock is not None:
                import socket

                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        up = DelayLine(up_ms, jitter_ms, mbps, rng.randrange(1 << 30))
        down = DelayLine(down_ms, jitter_ms, mbps, rng.randrange(1 << 30))
        await asyncio.gather(_pump(c_reader, s_writer, up), _pump(s_reader, c_writer, down))

    server = await asyncio.start_server(handle, *listen)
    if ready is not None:
        ready.set()
    print(
        f"netproxy: {listen[0]}:{listen[1]} -> {target[0]}:{target[1]}, one-way {up_ms}/{down_ms} ms, "
        f"jitter {jitter_ms} ms, bandwidth {'unlimited' if not mbps else f'{mbps} Mbit/s'}",
        flush=True,
    )
    async with server:
        await server.serve_forever()


def _addr(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host or "127.0.0.1", int(port)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench netproxy",
        description="TCP proxy that delays each direction (a real network hop for benches; use tc netem "
        "where the kernel has it).",
    )
    p.add_argument("--listen", default="127.0.0.1:9000", help="HOST:PORT to accept clients on")
    p.add_argument("--target", default="127.0.0.1:8000", help="HOST:PORT of the verifier")
    p.add_argument("--delay-ms", type=float, default=25.0, help="one-way delay each direction (RTT = 2x)")
    p.add_argument(
        "--up-ms", type=float, default=None, help="one-way delay client->server (overrides --delay-ms)"
    )
    p.add_argument(
        "--down-ms", type=float, default=None, help="one-way delay server->client (overrides --delay-ms)"
    )
    p.add_argument(
        "--jitter-ms", type=float, default=0.0, help="uniform jitter +/- this much (never reorders)"
    )
    p.add_argument("--bandwidth-mbps", type=float, default=0.0, help="bandwidth cap per direction (0: none)")
    a = p.parse_args(argv)
    up = a.delay_ms if a.up_ms is None else a.up_ms
    down = a.delay_ms if a.down_ms is None else a.down_ms
    with contextlib.suppress(Exception):
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(run_proxy(_addr(a.listen), _addr(a.target), up, down, a.jitter_ms, a.bandwidth_mbps))
    return 0


if __name__ == "__main__":
    sys.exit(main())
