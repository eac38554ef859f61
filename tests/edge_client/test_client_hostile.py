"""The edge client against a misbehaving verifier: stopping early and waiting forever. A scripted
WebSocket server (tests/edge_client/hostile_verifier.py) speaks the wire protocol and then lies,
stalls or drops. Every failure must be a GenerationError naming what was wrong, bounded in time, with
the tokens committed before it kept, and the client must stay usable for the next generation; a
consumer that stops early cancels at the verifier."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any

import pytest

from edge_client.client import (
    GenerationError,
    ProtocolViolation,
    SyncEdgeClient,
    Timeouts,
    VerifierTimeout,
)
from shared.errors import ErrorCode
from shared.messages import (
    Close,
    encode,
)
from shared.protocol import ClientState
from tests.edge_client.fake_drafter import FakeDrafter
from tests.edge_client.hostile_verifier import (
    FAST,
    PROMPT,
    Honest,
    Liar,
    V,
    _client,
    _honest_tokens,
    _liar_in_thread,
    _run,
    _serve_honestly,
    _tokens,
    _welcome,
    liar,
)


def test_closing_the_stream_early_cancels_at_the_verifier_and_the_session_goes_on() -> None:
    d = FakeDrafter(V)

    async def main() -> tuple[Liar, list[int], list[int]]:
        async with liar(_serve_honestly, d.vocab_fingerprint()) as lv:
            c = _client(lv.url, d)
            agen = c.generate(PROMPT, max_new_tokens=50)
            async for _ in agen:
                break
            await agen.aclose()
            assert c.proto.state is not ClientState.GENERATING
            second = await _tokens(c, 6)
            third = await _tokens(c, 6)
            await c.close()
            return lv, second, third

    lv, second, third = _run(main())
    assert lv.connections == 1  # the same session went on
    assert lv.sessions[0].cancels == 1
    assert second == third == _honest_tokens(6)


def test_a_cancelled_consumer_task_cancels_the_generation() -> None:
    d = FakeDrafter(V)

    async def main() -> tuple[Liar, list[int]]:
        async with liar(_serve_honestly, d.vocab_fingerprint()) as lv:
            c = _client(lv.url, d)
            got = asyncio.Event()

            async def consume() -> None:
                async for _ in c.generate(PROMPT, max_new_tokens=500):
                    got.set()
                    await asyncio.sleep(3600)

            task = asyncio.create_task(consume())
            await got.wait()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            out = await _tokens(c, 5)
            await c.close()
            return lv, out

    lv, out = _run(main())
    assert out == _honest_tokens(5)
    assert lv.connections == 1 and lv.sessions[0].cancels == 1


def test_an_exception_in_the_consumer_leaves_the_client_usable() -> None:
    """The consumer raises inside `async for` (the iterator is dropped, not closed): the next
    generate takes the abandoned generation over, cancels it and runs on the same session."""
    d = FakeDrafter(V)

    async def main() -> tuple[Liar, list[int]]:
        async with liar(_serve_honestly, d.vocab_fingerprint()) as lv:
            c = _client(lv.url, d)
            agen = c.generate(PROMPT, max_new_tokens=500)
            with pytest.raises(KeyError):
                async for _ in agen:
                    raise KeyError("consumer bug")
            out = await _tokens(c, 5)  # `agen` is still referenced: never closed
            with pytest.raises(GenerationError, match="abandoned"):
                await agen.__anext__()
            await c.close()
            return lv, out

    lv, out = _run(main())
    assert out == _honest_tokens(5)
    assert lv.connections == 1 and lv.sessions[0].cancels == 1


def test_closing_the_client_with_a_generation_left_open_cancels_it() -> None:
    d = FakeDrafter(V)

    async def main() -> tuple[Liar, Any]:
        async with liar(_serve_honestly, d.vocab_fingerprint()) as lv:
            c = _client(lv.url, d)
            agen = c.generate(PROMPT, max_new_tokens=500)
            await agen.__anext__()
            await c.close()
            for _ in range(100):  # the verifier reads the cancel before the close
                if lv.sessions[0].cancels:
                    break
                await asyncio.sleep(0.01)
            return lv, agen

    lv, _agen = _run(main())
    assert lv.sessions[0].cancels == 1


def test_breaking_out_of_the_sync_client_cancels_the_generation() -> None:
    d = FakeDrafter(V)
    with _liar_in_thread(_serve_honestly, d.vocab_fingerprint()) as lv:
        with SyncEdgeClient(lv.url, d, timeouts=FAST) as c:
            for _ in c.generate(PROMPT, max_new_tokens=500):
                break
            out = c.complete(PROMPT, max_new_tokens=4)
    assert out.tokens == _honest_tokens(4)
    assert lv.connections == 1 and lv.sessions[0].cancels == 1


def test_a_bad_frame_ends_the_generation_and_the_next_one_reconnects() -> None:
    d = FakeDrafter(V)

    async def script(s: Honest) -> None:
        await s.welcome()
        if len(lv_box) == 1 and lv_box[0].connections == 1:
            await s.next()  # the prompt, answered
            await s.next()  # the first tree, answered
            await s.ws.send(b"\xc1 not msgpack")
            await asyncio.sleep(3600)
        await s.serve()

    lv_box: list[Liar] = []

    async def main() -> tuple[Liar, list[int], list[int]]:
        async with liar(script, d.vocab_fingerprint()) as lv:
            lv_box.append(lv)
            c = _client(lv.url, d)
            with pytest.raises(ProtocolViolation) as info:
                await _tokens(c, 20)
            assert info.value.code is ErrorCode.BAD_FRAME
            assert c.last is not None
            kept = list(c.last.tokens)
            out = await _tokens(c, 5)
            await c.close()
            return lv, kept, out

    lv, kept, out = _run(main())
    assert kept == _honest_tokens(2)  # the two honest verdicts' tokens are kept
    assert out == _honest_tokens(5)
    assert lv.connections == 2


def test_no_welcome_is_a_timeout() -> None:
    d = FakeDrafter(V)

    async def script(s: Honest) -> None:
        await s.ws.recv()  # the hello, never answered
        await asyncio.sleep(3600)

    async def main() -> None:
        async with liar(script, d.vocab_fingerprint()) as lv:
            c = _client(lv.url, d, timeouts=Timeouts(welcome_s=0.3, close_s=0.3))
            t0 = time.monotonic()
            with pytest.raises(VerifierTimeout, match="welcome") as info:
                await c.connect()
            assert info.value.awaited == "welcome"
            assert time.monotonic() - t0 < 3

    _run(main())


def test_a_verifier_that_answers_pings_but_sends_no_verdict_is_a_timeout() -> None:
    d = FakeDrafter(V)

    async def script(s: Honest) -> None:
        await s.welcome()
        await s.next()  # the prompt: answered
        await s.ws.recv()  # the first tree: never answered (pings are, by the library)
        await asyncio.sleep(3600)

    async def main() -> list[int]:
        async with liar(script, d.vocab_fingerprint()) as lv:
            c = _client(lv.url, d, timeouts=Timeouts(verdict_s=0.5, close_s=0.3), resume=False)
            t0 = time.monotonic()
            with pytest.raises(VerifierTimeout, match="verdict") as info:
                await _tokens(c, 20)
            assert info.value.awaited == "verdict"
            assert time.monotonic() - t0 < 4
            assert c.last is not None
            return list(c.last.tokens)

    assert _run(main()) == _honest_tokens(1)


def test_the_verdict_timeout_follows_the_advertised_verify_cost() -> None:
    w = _welcome("0" * 64, verify_cost_ms={1: 10.0, 64: 2000.0})
    assert Timeouts(verdict_s=1.0, verdict_cost_x=2.0).verdict_timeout(w) == 4.0
    assert Timeouts(verdict_s=1.0, verdict_cost_x=100.0).verdict_timeout(w) == 10.0  # capped
    assert Timeouts(verdict_s=30.0).verdict_timeout(_welcome("0" * 64, verify_cost_ms={})) == 30.0
    with pytest.raises(ValueError, match="verdict_s"):
        Timeouts(verdict_s=0)


class _DeafServer:
    """A raw WebSocket server that sends the frames it is given and never answers anything,
    not even the closing handshake, and never closes the TCP connection."""

    def __init__(self, frames: Callable[[bytes], list[bytes]]) -> None:
        self.frames = frames  # the client's first frame (the hello's payload) -> frames to send
        self.writers: list[asyncio.StreamWriter] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        import base64
        import hashlib

        self.writers.append(writer)
        head = await reader.readuntil(b"\r\n\r\n")
        key = next(
            line.split(b":", 1)[1].strip()
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"sec-websocket-key:")
        )
        accept = base64.b64encode(hashlib.sha1(key + b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11").digest())
        writer.write(
            b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            b"Sec-WebSocket-Accept: " + accept + b"\r\n\r\n"
        )
        hello = await _read_client_frame(reader)
        for f in self.frames(hello):
            writer.write(_server_frame(f))
        await writer.drain()
        with contextlib.suppress(Exception):
            while await reader.read(1 << 16):  # read and ignore everything, the close included
                pass
        await asyncio.sleep(3600)


async def _read_client_frame(reader: asyncio.StreamReader) -> bytes:
    _, b1 = await reader.readexactly(2)
    n = b1 & 0x7F
    if n == 126:
        n = int.from_bytes(await reader.readexactly(2), "big")
    elif n == 127:
        n = int.from_bytes(await reader.readexactly(8), "big")
    mask = await reader.readexactly(4)
    payload = await reader.readexactly(n)
    return bytes(b ^ mask[i % 4] for i, b in enumerate(payload))


def _server_frame(payload: bytes) -> bytes:
    n = len(payload)
    head = bytes([0x82]) + (bytes([n]) if n < 126 else bytes([126]) + n.to_bytes(2, "big"))
    return head + payload


def test_a_close_message_without_a_tcp_close_does_not_hang() -> None:
    """The verifier sends the protocol's `close` right after the welcome and then neither answers
    the closing handshake nor closes TCP: the generation fails at once, closing takes close_s."""
    d = FakeDrafter(V)
    fp = d.vocab_fingerprint()
    deaf = _DeafServer(lambda hello: [encode(_welcome(fp)), encode(Close("maintenance"))])

    async def main() -> None:
        server = await asyncio.start_server(deaf.handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            c = _client(f"ws://127.0.0.1:{port}/v1/session", d, timeouts=Timeouts(close_s=0.3))
            t0 = time.monotonic()
            with pytest.raises(GenerationError, match="closed the session: maintenance"):
                await _tokens(c, 8)
            await c.close()
            assert time.monotonic() - t0 < 4
        finally:
            for w in deaf.writers:
                w.close()
            server.close()

    _run(main())
