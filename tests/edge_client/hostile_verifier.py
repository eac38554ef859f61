"""A scripted verifier for the edge client's hostile tests: an honest session on the protocol's own
server side (Honest) that a test's script makes lie, stall or drop, served on a free local port
(liar, or in a thread for the sync client), with the settings and helpers the tests share."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
from websockets.asyncio.server import ServerConnection, serve
from websockets.exceptions import ConnectionClosed

from edge_client.client import (
    EdgeClient,
    Timeouts,
)
from shared.messages import (
    Hello,
    Message,
    Mode,
    Prompt,
    SessionLimits,
    Tree,
    Verdict,
    Welcome,
    decode,
    encode,
)
from shared.protocol import CancelReceived, PromptReceived, ServerProtocol, VerifyTree
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
