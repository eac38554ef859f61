"""The WebSocket endpoint of the verifier: one socket around one `ServerSession`.

`serve_session` checks the origin, readiness and the handshake limit, then runs a reader (frames
into the `ServerSession`, at most `frames_per_s`, not while the client leaves its replies unread)
and a writer (the session's outbox onto the socket). It lives apart from `cloud_verifier.session`
because it reads the app's shared state (`AppState`), which itself holds the open sessions.

A session can change connections once, before its first prompt: a verifier with an address of its
own (`AppState.direct`, a fleet replica's, reached past the fleet's proxy) offers it in the welcome
to a client that asked (hello.features `session.direct`). A connection to that address whose hello
names the session's resume token, with the same key, takes the session over (`claim`): it gets the
welcome again and carries the session from then on, while the first connection stops reading and
writing and stays open, idle, until the session ends. That idle connection is what a fleet's proxy
counts (its session cap, autoscaling, a replica's drain), so the proxy sees every session while no
frame of it passes through the proxy.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Collection

from fastapi import WebSocket
from starlette.websockets import WebSocketDisconnect

from cloud_verifier.app_state import AppState
from cloud_verifier.server_config import ServerConfig
from cloud_verifier.session import CloseRequest, ServerSession
from shared.errors import CloseCode, ProtocolError
from shared.messages import Hello, decode, encode

log = logging.getLogger(__name__)


async def serve_session(ws: WebSocket, state: AppState, origins: Collection[str]) -> None:
    """Serve one WebSocket until it closes."""
    config = state.config
    origin = ws.headers.get("origin")
    if origin is not None and "*" not in origins and origin not in origins:
        # a browser page from another site (non-browser clients send no Origin)
        await ws.close(CloseCode.POLICY_VIOLATION, f"origin {origin[:100]!r} is not allowed")
        return
    await ws.accept()
    if not state.ready or state.engine is None or state.info is None or state.limits is None:
        why = "draining" if state.draining else "not ready"
        await ws.close(CloseCode.TRY_AGAIN_LATER, f"verifier {why}, try again later")
        return
    if len(state.sessions) - state.admitted >= config.max_handshakes:
        state.metrics.rejected_sessions.inc()
        await ws.close(CloseCode.TRY_AGAIN_LATER, "try again later: too many connections in handshake")
        return
    auth = ws.headers.get("authorization", "")
    bearer = auth[7:].strip() if auth.lower().startswith("bearer ") else None
    first: bytes | None = None
    if state.offers:  # the connection may be a client moving its session here (welcome.direct)
        first = await _first_frame(ws, config)
        if first is None:
            return
        moving = claim(state, first, bearer)
        if moving is not None:
            await _serve_moved(ws, state, moving)
            return
    session = ServerSession(
        state.engine,
        state.info,
        state.limits,
        state.keys,
        state.metrics,
        bearer,
        state.admission,
        state.parked,
        state.direct,
        state.offers,
    )
    state.sessions.add(session)
    state.metrics.sessions.set(len(state.sessions))
    session.writer = asyncio.create_task(_writer(ws, session))
    try:
        dropped = await _read_until_moved(ws, session, config, first)
    except BaseException:
        if not session.moved.is_set():
            await _let_go(state, session, dropped=False)
        raise
    if dropped is None:  # the session went to its direct connection: this one holds its place
        await _hold(ws, session)
    else:
        await _let_go(state, session, dropped)


async def _let_go(state: AppState, session: ServerSession, dropped: bool) -> None:
    """The session's connection is gone: a drop (no close from either side) keeps the session for
    its client's resume, anything else closes it; the writer gets 5 s to send what is queued."""
    if not (dropped and session.park()):
        session.close(CloseCode.GOING_AWAY, "connection closed")
    state.metrics.parked_sessions.set(len(state.parked))
    state.sessions.discard(session)
    state.metrics.sessions.set(len(state.sessions))
    writer = session.writer
    if writer is not None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(writer, timeout=5)
        writer.cancel()
    session.done.set()


async def _first_frame(ws: WebSocket, config: ServerConfig) -> bytes | None:
    """The connection's first frame (the hello), within the hello timeout; None when the
    connection went or the time ran out (then closed)."""
    try:
        async with asyncio.timeout(config.hello_timeout_s):
            msg = await ws.receive()
    except TimeoutError:
        with contextlib.suppress(Exception):
            await ws.close(CloseCode.POLICY_VIOLATION, f"no hello within {config.hello_timeout_s:g} s")
        return None
    except WebSocketDisconnect:
        return None
    if msg["type"] == "websocket.disconnect":
        return None
    data = msg.get("bytes")
    if data is None:
        text = (msg.get("text") or "").encode()
        data = b"\xc1" if text else text  # text frames are not protocol frames
    return bytes(data)


def claim(state: AppState, first: bytes, bearer: str | None) -> ServerSession | None:
    """The session that a connection whose first frame is `first` takes over: a hello naming the
    resume token of a session offered this verifier's address (welcome.direct) and not yet prompted,
    with the same vocabulary and the same API key or bearer token. None: a session of its own."""
    try:
        msg = decode(first)
    except ProtocolError:
        return None
    if not isinstance(msg, Hello) or msg.resume is None:
        return None
    session = state.offers.get(msg.resume)
    if session is None or session.closed or session.moved.is_set() or session.generating:
        return None
    if msg.vocab_fingerprint != session.info.vocab_fingerprint:
        return None
    given = (msg.api_key or bearer or "").encode()
    if not secrets.compare_digest(given, session.credential.encode()):
        return None
    del state.offers[msg.resume]
    return session


async def _serve_moved(ws: WebSocket, state: AppState, session: ServerSession) -> None:
    """Carry on `session` on this connection: its first connection stops reading and writing
    (it holds the session's place until the session ends), this one gets the session's welcome
    again, then its frames."""
    session.moved.set()
    if session.writer is not None:
        session.writer.cancel()  # (cancelled before it takes a frame off the outbox)
    state.metrics.direct_moves.inc()
    log.info("session moved to its direct connection", extra={"session": session.sid})
    welcomed = session.proto.welcomed
    assert welcomed is not None
    session.writer = asyncio.create_task(_writer(ws, session, first=encode(welcomed)))
    try:
        dropped = await _reader(ws, session, state.config)
    except BaseException:
        await _let_go(state, session, dropped=False)
        raise
    await _let_go(state, session, dropped)


async def _read_until_moved(
    ws: WebSocket, session: ServerSession, config: ServerConfig, first: bytes | None
) -> bool | None:
    """`_reader` until it ends (its result) or another connection takes the session over (None)."""
    reading = asyncio.create_task(_reader(ws, session, config, first))
    moving = asyncio.create_task(session.moved.wait())
    try:
        await asyncio.wait({reading, moving}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        moving.cancel()
        if not reading.done():
            reading.cancel()
            with contextlib.suppress(BaseException):
                await reading
    if session.moved.is_set():
        return None
    return reading.result()


async def _hold(ws: WebSocket, session: ServerSession) -> None:
    """A moved session's first connection: open and idle (what arrives is dropped) until the
    session ends on its direct connection, then closed; or until its client closes it. It holds the
    session's place where connections are counted (a fleet's session cap, autoscaling, drain)."""
    ended = asyncio.create_task(session.done.wait())
    try:
        while not session.done.is_set():
            receiving = asyncio.create_task(ws.receive())
            await asyncio.wait({receiving, ended}, return_when=asyncio.FIRST_COMPLETED)
            if not receiving.done():
                receiving.cancel()
                break
            try:
                msg = receiving.result()
            except Exception:  # (WebSocketDisconnect, a broken socket)
                return
            if msg["type"] == "websocket.disconnect":
                return
    finally:
        ended.cancel()
    with contextlib.suppress(Exception):
        await ws.close(CloseCode.NORMAL, "the session ended on its direct connection")


class FrameBudget:
    """A token bucket: `rate` frames a second (a frame costs 1 + one per 64 KiB), `burst` seconds
    of it saved up. `take` says how long to wait before the frame may be handled (0: now)."""

    def __init__(self, rate: float, burst_s: float = 2.0) -> None:
        self.rate = rate
        self.capacity = max(rate * burst_s, 1.0)
        self.tokens = self.capacity
        self.at = time.monotonic()

    def take(self, nbytes: int) -> float:
        if self.rate <= 0:
            return 0.0
        now = time.monotonic()
        self.tokens = min(self.capacity, self.tokens + (now - self.at) * self.rate)
        self.at = now
        self.tokens -= 1 + nbytes // 65536
        return 0.0 if self.tokens >= 0 else -self.tokens / self.rate


async def _reader(
    ws: WebSocket, session: ServerSession, config: ServerConfig, first: bytes | None = None
) -> bool:
    """Read frames into the session (`first`, already read, first) until it closes (False: by
    either side's protocol) or the connection goes without a protocol close (True: a drop)."""
    opened = time.monotonic()
    budget = FrameBudget(config.frames_per_s)
    while not session.closed:
        # back-pressure: a client that does not read its replies is not read either
        await session.writable.wait()
        if session.closed:
            return False
        now = time.monotonic()
        if not session.admitted:
            timeout = opened + config.hello_timeout_s - now
            if timeout <= 0:
                session.close(CloseCode.POLICY_VIOLATION, f"no hello within {config.hello_timeout_s:g} s")
                return False
        else:
            timeout = max(session.last_activity + config.idle_timeout_s - now, 0.05)
        if first is not None:
            session.receive(first)
            first = None
            continue
        try:
            # asyncio.timeout: under Python 3.11 wait_for drops a cancel that meets an arriving frame
            async with asyncio.timeout(timeout):
                msg = await ws.receive()
        except TimeoutError:
            if session.admitted and (
                session.working or time.monotonic() - session.last_activity < config.idle_timeout_s
            ):
                continue  # the engine is working for it (e.g. an ar stream), or it just got a verdict
            if session.admitted:
                session.close(CloseCode.GOING_AWAY, "idle timeout")
            continue  # (not welcomed: the hello deadline above closes it)
        except WebSocketDisconnect:
            return True
        if msg["type"] == "websocket.disconnect":  # (a client's protocol close ends the loop first)
            return True
        data = msg.get("bytes")
        if data is None:
            data = (msg.get("text") or "").encode()
            data = b"\xc1" if data else data  # text frames are not protocol frames
        wait = budget.take(len(data))
        if wait > 0:  # over the frame rate: slow this connection down, nobody else
            await asyncio.sleep(wait)
        session.receive(data)
    return False


async def _writer(ws: WebSocket, session: ServerSession, first: bytes | None = None) -> None:
    """Put the session's outbox on the socket (`first` before it) until a close request."""
    try:
        if first is not None:
            await ws.send_bytes(first)
        while True:
            item = await session.outbox.get()
            if isinstance(item, CloseRequest):
                with contextlib.suppress(Exception):
                    await ws.close(item.code, item.reason)
                return
            await ws.send_bytes(item)
            session.sent()
    except Exception:  # the peer went away: the reader sees the disconnect
        return
