"""The edge client against a misbehaving verifier: a scripted WebSocket server speaks the wire protocol
(shared.messages, the protocol's own server side for the honest parts) and then lies, stalls or
drops. Every failure must be a GenerationError naming what was wrong, bounded in time, with the
tokens committed before it kept, and the client must stay usable for the next generation."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import pytest
from websockets.asyncio.server import ServerConnection, serve
from websockets.exceptions import ConnectionClosed

from edge_client.client import (
    ConnectionLost,
    EdgeClient,
    GenerationError,
    ProtocolViolation,
    ResumeConfig,
    SyncEdgeClient,
    Timeouts,
    VerifierTimeout,
)
from shared.errors import ErrorCode
from shared.messages import (
    Close,
    Hello,
    Message,
    Mode,
    Prompt,
    SessionLimits,
    Stale,
    Tree,
    Verdict,
    Welcome,
    decode,
    encode,
)
from shared.protocol import CancelReceived, ClientState, PromptReceived, ServerProtocol, VerifyTree
from tests.edge_client.fake_drafter import FakeDrafter

V = 64
LIMITS = SessionLimits(max_nodes=32, max_depth=8, max_pending=4, max_bytes=1 << 20, max_context=512)
PROMPT = [5, 6, 7, 8]
FAST = Timeouts(welcome_s=2.0, verdict_s=2.0, cancel_s=2.0, close_s=0.5)
T = TypeVar("T")


def _welcome(fingerprint: str, **kw: Any) -> Welcome:
    fields: dict[str, Any] = {
        "session_id": "liar",
        "model_id": "liar",
        "vocab_size": V,
        "eos_ids": (0,),
        "allowed_modes": tuple(Mode),
        "limits": LIMITS,
        "verify_cost_ms": {1: 1.0, 32: 2.0},
        "vocab_fingerprint": fingerprint,
    }
    fields.update(kw)
    return Welcome(**fields)


def _bonus(length: int) -> int:
    return 1 + (length * 7) % (V - 1)  # never 0, the EOS id


@dataclass
class Honest:
    """One session answered by the protocol's own server side: every round accepts nothing and
    adds a bonus token, the generation ends at max_new_tokens, a cancel ends it."""

    ws: ServerConnection
    fingerprint: str
    srv: ServerProtocol = field(init=False)
    prompt_len: int = 0
    cancels: int = 0
    prompts: list[Prompt] = field(default_factory=list)
    trees: dict[int, Tree] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.srv = ServerProtocol(vocab_size=V, limits=LIMITS)
        self.srv.allowed_modes = frozenset(Mode)

    async def flush(self) -> None:
        for frame in self.srv.data_to_send():
            await self.ws.send(frame)

    async def welcome(self, **kw: Any) -> None:
        msg = decode(await _recv_bytes(self.ws))
        assert isinstance(msg, Hello)
        self.srv.receive(encode(msg))
        self.srv.welcome(_welcome(self.fingerprint, **kw))
        await self.flush()

    async def next(self) -> Message:
        """Read one client frame and answer it honestly; returns it."""
        data = await _recv_bytes(self.ws)
        msg = decode(data)
        if isinstance(msg, Tree):
            self.trees[msg.round] = msg
        for ev in self.srv.receive(data):
            if isinstance(ev, PromptReceived):
                self.prompt_len = len(ev.committed)
                self.prompts.append(ev.prompt)
                self.answer(0)
            elif isinstance(ev, VerifyTree):
                self.answer(ev.round)
            elif isinstance(ev, CancelReceived):
                self.cancels += 1
        await self.flush()
        return msg

    def answer(self, rnd: int) -> None:
        while True:
            gen = self.srv.gen
            assert gen is not None
            n = len(gen.committed)
            done = n + 1 - self.prompt_len >= gen.prompt.max_new_tokens
            tok, none = np.asarray([_bonus(n)], np.int32), np.zeros(0, np.int32)
            v = Verdict(rnd, tok, none, True, n + 1, done=done, reason="length" if done else None)
            nxt = self.srv.verdict(v)
            if nxt is None:
                return
            rnd = nxt.round

    async def serve(self) -> None:
        while True:
            await self.next()

    def verdict_frame(
        self, rnd: int, tokens: Sequence[int], accepted: Sequence[int] = (), **kw: Any
    ) -> bytes:
        gen = self.srv.gen
        n = len(gen.committed) if gen is not None else self.prompt_len
        fields: dict[str, Any] = {
            "has_bonus": len(tokens) == len(accepted) + 1,
            "committed_len": n + len(tokens),
        }
        fields.update(kw)
        return encode(Verdict(rnd, np.asarray(tokens, np.int32), np.asarray(accepted, np.int32), **fields))


async def _recv_bytes(ws: ServerConnection) -> bytes:
    data = await ws.recv()
    assert isinstance(data, bytes)
    return data


@dataclass
class Liar:
    url: str
    connections: int = 0
    sessions: list[Honest] = field(default_factory=list)


Script = Callable[[Honest], Coroutine[Any, Any, None]]


@contextlib.asynccontextmanager
async def liar(script: Script, fingerprint: str) -> AsyncIterator[Liar]:
    """A verifier on a free local port running `script` on each connection."""
    box = Liar("")

    async def handler(ws: ServerConnection) -> None:
        box.connections += 1
        session = Honest(ws, fingerprint)
        box.sessions.append(session)
        # the script ends, or the connection does (a script may sleep to keep a connection open)
        task = asyncio.create_task(script(session))
        closed = asyncio.create_task(ws.wait_closed())
        await asyncio.wait({task, closed}, return_when=asyncio.FIRST_COMPLETED)
        for t in (task, closed):
            t.cancel()
        with contextlib.suppress(ConnectionClosed, asyncio.CancelledError):
            await task

    async with serve(handler, "127.0.0.1", 0, max_size=None, compression=None) as server:
        port = next(iter(server.sockets)).getsockname()[1]
        box.url = f"ws://127.0.0.1:{port}/v1/session"
        yield box


def _run(coro: Coroutine[Any, Any, T], limit_s: float = 20.0) -> T:
    """Run a test's coroutine, failing (not hanging) past limit_s."""

    async def bounded() -> T:
        return await asyncio.wait_for(coro, limit_s)

    return asyncio.run(bounded())


def _client(url: str, drafter: FakeDrafter, **kw: Any) -> EdgeClient:
    kw.setdefault("timeouts", FAST)
    return EdgeClient(url, drafter, **kw)


async def _tokens(c: EdgeClient, n: int = 8, **kw: Any) -> list[int]:
    async for _ in c.generate(PROMPT, max_new_tokens=n, **kw):
        pass
    assert c.last is not None
    return list(c.last.tokens)


def _honest_tokens(n: int) -> list[int]:
    out: list[int] = []
    for _ in range(n):
        out.append(_bonus(len(PROMPT) + len(out)))
    return out


async def _serve_honestly(s: Honest) -> None:
    await s.welcome()
    await s.serve()


# ------------------------------------------------------------------------ 1: stopping early


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


@contextlib.contextmanager
def _liar_in_thread(script: Script, fingerprint: str) -> Iterator[Liar]:
    """`liar` on an event loop of its own thread, for clients that run their own loop."""
    loop = asyncio.new_event_loop()
    box: list[Liar] = []
    stop = asyncio.Event()

    async def serve_until_stopped() -> None:
        async with liar(script, fingerprint) as lv:
            box.append(lv)
            await stop.wait()

    t = threading.Thread(target=loop.run_until_complete, args=(serve_until_stopped(),), daemon=True)
    t.start()
    deadline = time.monotonic() + 10
    while not box:
        assert t.is_alive() and time.monotonic() < deadline
        time.sleep(0.01)
    try:
        yield box[0]
    finally:
        loop.call_soon_threadsafe(stop.set)
        t.join(10)
        loop.close()


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


# ------------------------------------------------------------------------ 2: waiting forever


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


# ------------------------------------------------------------------------ 3: resuming


def test_a_verifier_that_drops_every_session_after_the_prompt_is_given_up_on() -> None:
    d = FakeDrafter(V)

    async def script(s: Honest) -> None:
        await s.welcome()
        await s.ws.recv()  # the prompt
        await s.ws.close(1011, "internal error")

    async def main() -> Liar:
        async with liar(script, d.vocab_fingerprint()) as lv:
            c = _client(lv.url, d, resume=ResumeConfig(attempts=3, backoff_s=0.01, max_backoff_s=0.05))
            with pytest.raises(ConnectionLost, match="4 times in a row with no new token"):
                await _tokens(c, 8)
            return lv

    lv = _run(main())
    assert lv.connections == 4


def test_progress_resets_the_count_of_drops() -> None:
    """A verifier that drops each session after one verdict still gets the generation done."""
    d = FakeDrafter(V)

    async def script(s: Honest) -> None:
        await s.welcome()
        await s.next()  # the prompt: answered with one token
        await s.ws.recv()
        await s.ws.close(1001, "going away")

    async def main() -> tuple[Liar, list[int]]:
        async with liar(script, d.vocab_fingerprint()) as lv:
            c = _client(lv.url, d, resume=ResumeConfig(attempts=2, backoff_s=0.01))
            return lv, await _tokens(c, 6)

    lv, out = _run(main())
    assert out == _honest_tokens(6) and lv.connections == 6


def test_the_clients_own_1009_is_not_resumed() -> None:
    d = FakeDrafter(V)

    async def script(s: Honest) -> None:
        await s.welcome()
        await s.ws.recv()
        await s.ws.send(b"\x00" * ((1 << 22) + 1))  # over the client's 4 MiB frame limit
        await asyncio.sleep(3600)

    async def main() -> Liar:
        async with liar(script, d.vocab_fingerprint()) as lv:
            c = _client(lv.url, d, resume=ResumeConfig(attempts=5, backoff_s=0.01))
            with pytest.raises(GenerationError, match="1009") as info:
                await _tokens(c, 8)
            assert not isinstance(info.value, ConnectionLost)
            return lv

    assert _run(main()).connections == 1


@pytest.mark.parametrize("code", [1002, 1003, 1007, 1008, 1009, 1000])
def test_a_close_for_a_protocol_reason_is_not_resumed(code: int) -> None:
    d = FakeDrafter(V)

    async def script(s: Honest) -> None:
        await s.welcome()
        await s.ws.recv()
        await s.ws.close(code, "no")

    async def main() -> Liar:
        async with liar(script, d.vocab_fingerprint()) as lv:
            c = _client(lv.url, d, resume=ResumeConfig(attempts=5, backoff_s=0.01))
            with pytest.raises(GenerationError, match=str(code)) as info:
                await _tokens(c, 8)
            assert not isinstance(info.value, ConnectionLost)
            return lv

    assert _run(main()).connections == 1


# ------------------------------------------------------------------------ 4: the client's limits

Lie = Callable[[Honest], bytes]


def _after_one_honest_round(lie: Lie) -> Script:
    """Answer the prompt and the first tree honestly, then send `lie` for the second tree."""

    async def script(s: Honest) -> None:
        await s.welcome()
        await s.next()
        await s.next()
        msg = decode(await _recv_bytes(s.ws))
        assert isinstance(msg, Tree)
        s.trees[msg.round] = msg
        s.srv.receive(encode(msg))
        await s.ws.send(lie(s))
        await asyncio.sleep(3600)

    return script


def _last_round(s: Honest) -> int:
    return max(s.trees)


def _path_lie(s: Honest, kind: str) -> bytes:
    """A verdict for the last tree whose accepted nodes or tokens are not the tree's."""
    r = _last_round(s)
    tree = s.trees[r].tree
    kids = [i for i in range(tree.num_nodes) if tree.parents[i] == -1]
    deep = [i for i in range(tree.num_nodes) if tree.parents[i] != -1]
    if kind == "node outside the tree":
        return s.verdict_frame(r, [1, 2], [tree.num_nodes])
    if kind == "negative node":
        return s.verdict_frame(r, [1, 2], [-1])
    if kind == "not a path":
        return s.verdict_frame(r, [int(tree.tokens[deep[0]]), 2], [deep[0]])
    if kind == "tokens not the nodes'":
        t = int(tree.tokens[kids[0]])
        return s.verdict_frame(r, [(t + 1) % V or 1, 2], [kids[0]])
    if kind == "two bonus tokens":
        return s.verdict_frame(r, [3, 4], [], has_bonus=True)
    if kind == "has_bonus wrong":
        return s.verdict_frame(r, [3], [], has_bonus=False)
    raise AssertionError(kind)


LIES: dict[str, tuple[Lie, type[GenerationError], ErrorCode, str]] = {
    "4000 tokens for max_new_tokens 8": (
        lambda s: s.verdict_frame(_last_round(s), [3] * 4000, []),
        ProtocolViolation,
        ErrorCode.LIMIT_EXCEEDED,
        "tokens",
    ),
    "a token >= vocab_size": (
        lambda s: s.verdict_frame(_last_round(s), [V + 5], []),
        ProtocolViolation,
        ErrorCode.OUT_OF_RANGE,
        "tokens",
    ),
    "a negative token": (
        lambda s: s.verdict_frame(_last_round(s), [-3], []),
        ProtocolViolation,
        ErrorCode.OUT_OF_RANGE,
        "tokens",
    ),
    **{
        kind: (
            functools.partial(_path_lie, kind=kind),
            ProtocolViolation,
            ErrorCode.BAD_MESSAGE,
            fld,
        )
        for kind, fld in [
            ("node outside the tree", "accepted_nodes"),
            ("negative node", "accepted_nodes"),
            ("not a path", "accepted_nodes"),
            ("tokens not the nodes'", "tokens"),
            ("two bonus tokens", "tokens"),
            ("has_bonus wrong", "has_bonus"),
        ]
    },
    "a verdict for a round never sent": (
        lambda s: s.verdict_frame(_last_round(s) + 7, [3], []),
        ProtocolViolation,
        ErrorCode.BAD_ORDER,
        "round",
    ),
    "a duplicate verdict": (
        lambda s: s.verdict_frame(_last_round(s) - 1, [3], []),
        ProtocolViolation,
        ErrorCode.BAD_ORDER,
        "round",
    ),
    "committed_len going backwards": (
        lambda s: s.verdict_frame(_last_round(s), [3], [], committed_len=2),
        ProtocolViolation,
        ErrorCode.BAD_MESSAGE,
        "committed_len",
    ),
    "a next_round never sent": (
        lambda s: s.verdict_frame(_last_round(s), [3], [], next_round=99),
        ProtocolViolation,
        ErrorCode.BAD_ORDER,
        "next_round",
    ),
    "an empty verdict that is not done": (
        lambda s: s.verdict_frame(_last_round(s), [], [], has_bonus=False),
        ProtocolViolation,
        ErrorCode.BAD_MESSAGE,
        "done",
    ),
    "a stale for a round never sent": (
        lambda s: encode(Stale(_last_round(s) + 3, "x")),
        ProtocolViolation,
        ErrorCode.BAD_ORDER,
        "round",
    ),
    "garbage": (lambda s: b"\x93\x01\x02", ProtocolViolation, ErrorCode.BAD_FRAME, "frame"),
    "a second welcome": (
        lambda s: encode(_welcome(s.fingerprint)),
        ProtocolViolation,
        ErrorCode.BAD_ORDER,
        "state",
    ),
}


@pytest.mark.parametrize("lie", list(LIES))
def test_a_lying_verdict_is_refused_before_anything_is_emitted(lie: str) -> None:
    d = FakeDrafter(V)
    make, exc_type, code, fld = LIES[lie]
    chunks: list[str] = []

    async def main() -> tuple[list[int], ClientState]:
        async with liar(_after_one_honest_round(make), d.vocab_fingerprint()) as lv:
            c = _client(lv.url, d)
            with pytest.raises(exc_type) as info:
                async for chunk in c.generate(PROMPT, max_new_tokens=8):
                    chunks.append(chunk)
            assert info.value.code is code and info.value.field == fld, info.value
            assert c.last is not None
            tokens = list(c.last.tokens)
            state = c.proto.state
            await c.close()
            return tokens, state

    tokens, state = _run(main())
    assert tokens == _honest_tokens(2)  # the two honest rounds, nothing of the lie
    assert "".join(chunks) == "".join(f"<{t}>" for t in tokens)
    assert state is ClientState.START  # the lying connection was dropped


def test_verdicts_that_never_end_stop_at_max_new_tokens() -> None:
    """A verifier that keeps the generation going past max_new_tokens (done never set)."""
    d = FakeDrafter(V)

    async def script(s: Honest) -> None:
        await s.welcome()
        while True:
            msg = decode(await _recv_bytes(s.ws))
            n = s.prompt_len
            if isinstance(msg, Prompt):
                s.prompt_len = n = len(msg.tokens)
                rnd = 0
            else:
                assert isinstance(msg, Tree)
                rnd = msg.round
            s.prompt_len = n + 1
            await s.ws.send(
                encode(Verdict(rnd, np.asarray([3], np.int32), np.zeros(0, np.int32), True, n + 1))
            )

    async def main() -> list[int]:
        async with liar(script, d.vocab_fingerprint()) as lv:
            c = _client(lv.url, d)
            with pytest.raises(ProtocolViolation) as info:
                await _tokens(c, 8)
            assert info.value.field == "done"
            assert c.last is not None
            return list(c.last.tokens)

    assert _run(main()) == [3] * 7


# ------------------------------------------------------------------------ 5, 6: the welcome


UNUSABLE = "unusable welcome"
NO_FORWARD = "is not a forward time"  # shared.verify_cost's rule, applied as the welcome is read


@pytest.mark.parametrize(
    ("change", "fld", "said"),
    [
        ({"vocab_fingerprint": ""}, "welcome.vocab_fingerprint", UNUSABLE),
        ({"vocab_fingerprint": "not-hex"}, "welcome.vocab_fingerprint", UNUSABLE),
        ({"vocab_fingerprint": "A" * 64}, "welcome.vocab_fingerprint", UNUSABLE),
        ({"version": 7}, "welcome.version", UNUSABLE),
        ({"allowed_modes": ()}, "welcome.allowed_modes", UNUSABLE),
        ({"eos_ids": (V,)}, "welcome.eos_ids", UNUSABLE),
        # limits outside SessionLimits.RANGES are refused as the welcome is read
        ({"limits": SessionLimits(max_nodes=0)}, "limits.max_nodes", r"must be in \[1, "),
        ({"verify_cost_ms": {1: 0.0, 32: 2.0}}, "verify_cost_ms", NO_FORWARD),
        ({"verify_cost_ms": {1: 1.0, 32: 1e308}}, "verify_cost_ms", NO_FORWARD),
    ],
)
def test_an_unusable_welcome_is_refused(change: dict[str, Any], fld: str, said: str) -> None:
    d = FakeDrafter(V)

    async def script(s: Honest) -> None:
        await _recv_bytes(s.ws)
        await s.ws.send(encode(_welcome(s.fingerprint, **change)))
        await asyncio.sleep(3600)

    async def main() -> Liar:
        async with liar(script, d.vocab_fingerprint()) as lv:
            c = _client(lv.url, d)
            with pytest.raises(ProtocolViolation, match=said) as info:
                await _tokens(c, 4)
            assert info.value.field == fld
            return lv

    assert _run(main()).connections == 1  # refused for a reason: not retried


@pytest.mark.parametrize(
    "frame",
    [
        b"\xc1",
        encode(Verdict(0, np.asarray([1], np.int32), np.zeros(0, np.int32), True, 1)),
        encode(Close("bye")),
    ],
    ids=["garbage", "a verdict", "close"],
)
def test_no_welcome_but_something_else_is_a_generation_error(frame: bytes) -> None:
    d = FakeDrafter(V)

    async def script(s: Honest) -> None:
        await _recv_bytes(s.ws)
        await s.ws.send(frame)
        await asyncio.sleep(3600)

    async def main() -> None:
        async with liar(script, d.vocab_fingerprint()) as lv:
            c = _client(lv.url, d, resume=False)
            with pytest.raises(GenerationError):
                await c.connect()

    _run(main())


def test_a_text_frame_is_a_protocol_violation() -> None:
    d = FakeDrafter(V)

    async def script(s: Honest) -> None:
        await s.welcome()
        await s.ws.recv()
        await s.ws.send("a text frame")
        await asyncio.sleep(3600)

    async def main() -> None:
        async with liar(script, d.vocab_fingerprint()) as lv:
            c = _client(lv.url, d)
            with pytest.raises(ProtocolViolation, match="text frame") as info:
                await _tokens(c, 4)
            assert info.value.code is ErrorCode.BAD_FRAME

    _run(main())


def test_a_continue_after_a_dropped_session_resends_the_context() -> None:
    """The connection is dropped between turns (a lie ended it): the next `continue_` turn sends
    the context again instead of silently starting from nothing."""
    d = FakeDrafter(V)
    sessions: list[Honest] = []

    async def script(s: Honest) -> None:
        sessions.append(s)
        await s.welcome()
        await s.next()  # the prompt
        while s.srv.gen is not None:
            await s.next()
        if len(sessions) == 1:
            await s.ws.recv()  # the next prompt: answered with garbage
            await s.ws.send(b"\xc1")
            await asyncio.sleep(3600)
        await s.serve()

    async def main() -> list[Prompt]:
        async with liar(script, d.vocab_fingerprint()) as lv:
            c = _client(lv.url, d)
            first = await _tokens(c, 3)
            with pytest.raises(ProtocolViolation):
                await _tokens(c, 3, continue_=True)
            await _tokens(c, 3, continue_=True)
            assert first == _honest_tokens(3)
            return [p for s in sessions for p in s.prompts]

    prompts = _run(main())
    last = prompts[-1]
    assert not last.continue_
    assert last.tokens.tolist() == PROMPT + _honest_tokens(3) + PROMPT


# ------------------------------------------------------------------------ 5: the CLI


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--draft", "tiny", "--server", f"ws://127.0.0.1:{_free_port()}/v1/session"], "cannot reach"),
        (["--draft", "tiny", "--server", "http://example.invalid/"], "ws://"),
        (["--draft", "/no/such/draft.gguf"], "draft.gguf"),
    ],
    ids=["refused", "bad url", "missing draft"],
)
def test_the_cli_prints_one_line_for_a_failure(
    args: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from edge_client import cli

    rc = cli.main(["generate", "hello", "--raw", "--resume-attempts", "0", "--drafter", "torch", *args])
    err = capsys.readouterr().err
    assert rc != 0
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("edge-client: error: ") and needle in lines[0], err


def test_the_cli_prints_one_line_when_the_verifier_breaks_the_protocol(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from edge_client import cli
    from edge_client.drafters.registry import create_drafter

    tiny = create_drafter("torch", "tiny")
    fp, vocab = tiny.vocab_fingerprint(), tiny.vocab_size
    tiny.close()

    async def script(s: Honest) -> None:
        await _recv_bytes(s.ws)
        await s.ws.send(encode(_welcome(fp, vocab_size=vocab)))
        await _recv_bytes(s.ws)  # the prompt
        await s.ws.send(b"\xc1")
        await asyncio.sleep(3600)

    with _liar_in_thread(script, fp) as lv:
        argv = ["generate", "hello", "--raw", "--drafter", "torch", "--draft", "tiny", "--server", lv.url]
        rc = cli.main(argv)
    err = capsys.readouterr().err
    assert rc == 1 and "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("edge-client: error: the verifier broke the protocol"), err
    assert "BAD_FRAME" in lines[0]


# ------------------------------------------------------------------------ the real verifier


@pytest.mark.parametrize("prespec", [False, True])
def test_after_an_abandoned_generation_the_real_verifier_session_stays_exact(prespec: bool) -> None:
    """Abandoned mid-stream twice (closed, then dropped unclosed) with conditional trees in flight:
    the same session then generates exactly the target's tokens."""
    from edge_client.drafters.registry import create_drafter
    from tests.cloud_verifier.service import LiveServer, reference

    drafter = create_drafter("torch", "tiny")
    prompt = [5, 6, 7, 8, 9, 10, 11]

    async def main(url: str) -> tuple[list[int], bool]:
        c = EdgeClient(url, drafter, prespec=prespec, timeouts=FAST)
        agen = c.generate(prompt, max_new_tokens=200, raw=True)
        async for _ in agen:
            break
        await agen.aclose()
        session = c.welcome
        dropped = c.generate(prompt, max_new_tokens=200, raw=True)
        await dropped.__anext__()  # left open
        out = await _tokens_of(c, prompt, 40)
        same = c.welcome is session and session is not None
        await c.close()
        return out, same

    try:
        with LiveServer() as srv:
            out, same_session = _run(main(srv.ws), 120)
    finally:
        drafter.close()
    assert out == reference(tuple(prompt), 40)
    assert same_session


async def _tokens_of(c: EdgeClient, prompt: list[int], n: int) -> list[int]:
    async for _ in c.generate(prompt, max_new_tokens=n, raw=True):
        pass
    assert c.last is not None
    return list(c.last.tokens)
