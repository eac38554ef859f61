"""Raw session frames against a live verifier (bench.robustness.fuzz, bench.robustness.soak,
bench.end_to_end.prefill_share): token
ids as wire bytes, one frame received, an honest greedy session beside target-only decoding."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import msgpack
import numpy as np


def i32(xs: Sequence[int]) -> bytes:
    """Token ids as the wire's little-endian int32 bytes."""
    return np.asarray(xs, dtype="<i4").tobytes()


async def recv(ws: Any, timeout: float) -> dict[str, Any]:
    """The next frame of a session WebSocket, unpacked (a close raises)."""
    data = await asyncio.wait_for(ws.recv(), timeout)
    out: dict[str, Any] = msgpack.unpackb(data if isinstance(data, bytes) else data.encode())
    return out


async def honest_generation(url: str, hello: bytes, prompt: list[int], n: int) -> tuple[list[int], list[int]]:
    """The same greedy prompt as a tree session (empty trees: the bonus token each round) and as `ar`."""
    from websockets.asyncio.client import connect

    out = []
    for mode in ("greedy", "ar"):
        async with connect(url, max_size=None) as ws:
            await ws.send(hello)
            await ws.recv()
            await ws.send(
                msgpack.packb({"type": "prompt", "tokens": i32(prompt), "mode": mode, "max_new_tokens": n})
            )
            toks: list[int] = []
            rnd = 0
            while True:
                m = await recv(ws, 60)
                if m.get("type") != "verdict":
                    continue
                toks += np.frombuffer(m["tokens"], "<i4").tolist()
                if m["done"]:
                    break
                if mode == "greedy":
                    rnd += 1
                    L = len(prompt) + len(toks)
                    tree = {
                        "type": "tree",
                        "round": rnd,
                        "base": L,
                        "cond": b"",
                        "tokens": i32([1]),
                        "parents": i32([-1]),
                    }
                    await ws.send(msgpack.packb(tree))
            out.append(toks)
    return out[0], out[1]
