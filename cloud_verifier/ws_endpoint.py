"""The WebSocket endpoint of the verifier: one socket around one `ServerSession`.

`serve_session` checks the origin, readiness and the handshake limit, then runs a reader (frames
into the `ServerSession`, at most `frames_per_s`, not while the client leaves its replies unread)
and a writer (the session's outbox onto the socket). It lives apart from `cloud_verifier.session`
because it reads the app's shared state (`AppState`), which itself holds the open sessions.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Collection

from fastapi import WebSocket
from starlette.websockets import WebSocketDisconnect

from cloud_verifier.app_state import AppState
from cloud_verifier.server_config import ServerConfig
from cloud_verifier.session import CloseRequest, ServerSession
from shared.errors import CloseCode


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
    session = ServerSession(
        state.engine,
        state.info,
        state.limits,
        state.keys,
        state.metrics,
        bearer,
        state.admission,
        state.parked,
    )
    state.sessions.add(session)
    state.metrics.sessions.set(len(state.sessions))
    writer = asyncio.create_task(_writer(ws, session))
    dropped = False
    try:
        dropped = await _reader(ws, session, config)
    finally:
        # a drop (no close from either side) keeps the session for its client's resume
        if not (dropped and session.park()):
            session.close(CloseCode.GOING_AWAY, "connection closed")
        state.metrics.parked_sessions.set(len(state.parked))
        state.sessions.discard(session)
        state.metrics.sessions.set(len(state.sessions))
        with contextlib.suppress(Exception):
            await asyncio.wait_for(writer, timeout=5)
        writer.cancel()


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


async def _reader(ws: WebSocket, session: ServerSession, config: ServerConfig) -> bool:
    """Read frames into the session until it closes (False: by either side's protocol) or the
    connection goes without a protocol close (True: a drop)."""
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


async def _writer(ws: WebSocket, session: ServerSession) -> None:
    try:
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
