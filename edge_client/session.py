"""The edge's session with the verifier: connect, send and receive frames, resume after a drop.

`Session` owns the transport and the client's `shared.protocol.ClientProtocol`; on a dropped
connection (ConnectionLost) it reconnects with backoff, round robin over the replica URLs, and
checks that the verifier came back with the same model and vocabulary. EdgeClient
(edge_client.client) adds drafting, generation and text on top.

Under it, at the end of this module: the byte transports, a WebSocket and an in-process network
shaper.

The shaper emulates a link in the client's process (one-way delay per direction, jitter that never
reorders, a bandwidth cap), which is what tests use; benches can also put a real TCP delay proxy
(`python -m bench.netproxy`) between the client and the verifier.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import re
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, Self

from shared.errors import ErrorCode, ProtocolError
from shared.messages import FEATURES, PROTOCOL_VERSION, Close, Error, Hello, Welcome
from shared.protocol import ClientProtocol, ClientState


class GenerationError(RuntimeError):
    """The verifier refused the request or the session broke; `code`/`field` say what was wrong."""

    def __init__(self, message: str, code: ErrorCode | None = None, field: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.field = field


class ConnectionLost(GenerationError):
    """The connection to the verifier dropped (reset, restart, draining, overload): a generation can
    resume on a new session. A close for a reason of the protocol (1002, 1007, 1008, 1009) is not this."""


class ProtocolViolation(GenerationError):
    """The verifier broke the protocol (a frame that does not decode, a verdict for a round never
    sent, tokens outside the vocabulary or beyond max_new_tokens, an unusable welcome): `code` and
    `field` name what was wrong. Nothing of the offending frame reached the output; the connection
    is dropped (the next generation opens a new one)."""


class VerifierTimeout(GenerationError):
    """The verifier did not answer in time (Timeouts); `awaited` names what the client waited for:
    "welcome", "verdict", "cancel" or "close"."""

    def __init__(self, message: str, awaited: str) -> None:
        super().__init__(message)
        self.awaited = awaited


# close codes after which the same request may succeed on a new session (None: no close frame)
RESUMABLE_CLOSES = (None, 1001, 1006, 1011, 1012, 1013, 1014)

_CLOSE_WHY = {
    1002: "a protocol error",
    1003: "data it cannot accept",
    1007: "invalid data",
    1008: "a policy violation",
    1009: "a frame over the size limit",
    1010: "a missing extension",
}


def _closed(exc: TransportClosed) -> GenerationError:
    why = _CLOSE_WHY.get(exc.code) if exc.code is not None else None
    by = "the client closed the connection" if exc.by_client else "the verifier closed the connection"
    detail = f" ({exc.code}, {why})" if why else f" ({exc.code})" if exc.code is not None else ""
    message = f"{by}{detail}: {exc.reason or 'no reason given'}"
    if exc.code in RESUMABLE_CLOSES:
        return ConnectionLost(message)
    return GenerationError(message)


_FINGERPRINT = re.compile(r"[0-9a-f]{64}")


def check_welcome(w: Welcome, fingerprint: str) -> None:
    """Refuse a welcome the client cannot work with (ProtocolViolation, or GenerationError with
    VOCAB_MISMATCH when the vocabularies differ). A verifier that does not state its vocabulary
    cannot be trusted to verify this draft."""

    def bad(field: str, why: str) -> ProtocolViolation:
        return ProtocolViolation(
            f"unusable welcome from the verifier: {why}", ErrorCode.BAD_MESSAGE, f"welcome.{field}"
        )

    if w.version != PROTOCOL_VERSION:
        raise bad("version", f"protocol version {w.version}, the client speaks {PROTOCOL_VERSION}")
    if not _FINGERPRINT.fullmatch(w.vocab_fingerprint):
        shown = repr(w.vocab_fingerprint[:80]) if w.vocab_fingerprint else "empty"
        raise bad("vocab_fingerprint", f"the vocabulary fingerprint is {shown}, not 64 hex digits")
    if w.vocab_fingerprint != fingerprint:
        raise GenerationError(
            f"vocabulary mismatch: the draft model's tokenizer is not the target's ({w.model_id}); "
            "use a draft model built on the target's vocabulary",
            ErrorCode.VOCAB_MISMATCH,
            "vocab_fingerprint",
        )
    if not w.allowed_modes:
        raise bad("allowed_modes", "no mode is allowed")
    if any(not 0 <= t < w.vocab_size for t in w.eos_ids):
        raise bad("eos_ids", f"an end-of-generation id outside the vocabulary [0, {w.vocab_size})")
    lim = w.limits
    if lim.max_nodes < 1 or lim.max_depth < 1:
        raise bad("limits", f"max_nodes {lim.max_nodes} and max_depth {lim.max_depth} leave no tree")


@dataclass(frozen=True)
class Timeouts:
    """How long the client waits for the verifier (EdgeClient(timeouts=...)); running out raises
    VerifierTimeout naming what was awaited.

    welcome_s:      opening the connection, and then the welcome after the hello
    verdict_s:      with a round in flight, the longest time without a frame from the verifier (its
                    pings do not count); at least verdict_cost_x times the slowest verify the welcome
                    advertises (verify_cost_ms), up to 10 x verdict_s
    cancel_s:       after a cancel, the verdict that ends the generation (else the connection is
                    dropped, and the next generation opens a new one)
    close_s:        the closing handshake
    """

    welcome_s: float = 30.0
    verdict_s: float = 60.0
    verdict_cost_x: float = 100.0
    cancel_s: float = 10.0
    close_s: float = 5.0

    def __post_init__(self) -> None:
        for name in ("welcome_s", "verdict_s", "cancel_s", "close_s"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v > 0):
                raise ValueError(f"Timeouts.{name} must be a finite number of seconds > 0, got {v}")
        if not (math.isfinite(self.verdict_cost_x) and self.verdict_cost_x >= 0):
            raise ValueError(f"Timeouts.verdict_cost_x must be finite and >= 0, got {self.verdict_cost_x}")

    def verdict_timeout(self, welcome: Welcome) -> float:
        """The wait for a verdict on this verifier (see the class docstring)."""
        slowest_s = max(welcome.verify_cost_ms.values(), default=0.0) / 1e3
        return max(self.verdict_s, min(self.verdict_cost_x * slowest_s, 10 * self.verdict_s))


@dataclass(frozen=True)
class ResumeConfig:
    """Reconnecting after the connection drops (EdgeClient(resume=...)).

    attempts:  connection attempts per drop (each tries the next server URL, round robin); also the
               drops in a row that a generation survives with no new token between them (a verifier
               that drops every session after the prompt): one more ends it with ConnectionLost
    backoff_s: the first wait between attempts, doubled each time up to max_backoff_s (resumes in a
               row with no new token wait the same way)
    """

    attempts: int = 10
    backoff_s: float = 0.2
    max_backoff_s: float = 5.0

    def __post_init__(self) -> None:
        if self.attempts < 1 or not self.backoff_s >= 0 or not self.max_backoff_s >= self.backoff_s:
            raise ValueError("need attempts >= 1 and 0 <= backoff_s <= max_backoff_s")

    def delay(self, retry: int) -> float:
        """The wait before retry number `retry` (1: the first retry)."""
        return min(self.backoff_s * 2.0 ** max(0, min(retry - 1, 60)), self.max_backoff_s)


class Session:
    """One session with the verifier at a time (see the module docstring).

    server:    a URL, or several (replicas with no shared state): a dropped connection fails over
    api_key:   sent in the hello
    link:      emulate a network link in-process (one-way delays, jitter, bandwidth)
    transport: an async factory of the byte transport (default: a WebSocket to `server`)
    resume:    reconnect when the connection drops (True: ResumeConfig defaults; False: never)
    timeouts:  how long to wait for the verifier (Timeouts defaults)
    """

    def __init__(
        self,
        server: str | Sequence[str],
        *,
        api_key: str | None = None,
        link: LinkShape | None = None,
        transport: Callable[[], Awaitable[Transport]] | None = None,
        ca_file: str | None = None,
        resume: bool | ResumeConfig = True,
        timeouts: Timeouts | None = None,
    ) -> None:
        self.servers = [server] if isinstance(server, str) else list(server)
        if not self.servers:
            raise ValueError("EdgeClient needs at least one verifier URL")
        self._server_i = 0
        self.resume: ResumeConfig | None = (
            resume if isinstance(resume, ResumeConfig) else (ResumeConfig() if resume else None)
        )
        self.timeouts = timeouts or Timeouts()
        self.resumes: list[float] = []  # seconds each resume took (drop to the new session's welcome)
        self.ca_file = ca_file
        self.api_key = api_key
        self.link = link
        self._transport_factory = transport
        self._transport: Transport | None = None
        self.proto = ClientProtocol()
        self.welcome: Welcome | None = None
        # the context of a session that was dropped between generations: a `continue` prompt on
        # the next session re-sends it
        self._lost_context: list[int] = []

    def vocab_fingerprint(self) -> str:
        """The fingerprint of the vocabulary the hello announces (the subclass knows it)."""
        raise NotImplementedError

    @property
    def server(self) -> str:
        """The verifier URL in use."""
        return self.servers[self._server_i]

    # ------------------------------------------------------------------ connection
    async def _reconnect(self) -> None:
        """A new session after a drop: backoff, the next URL, and the same model and vocabulary."""
        assert self.resume is not None
        old = self.welcome
        t0 = time.perf_counter()
        await self._close_transport()
        self.welcome, self.proto = None, ClientProtocol()
        last: Exception | None = None
        for attempt in range(self.resume.attempts):
            if len(self.servers) > 1 or attempt:
                self._server_i = (self._server_i + 1) % len(self.servers)
            self.proto = ClientProtocol()  # a fresh session each attempt
            try:
                w = await self.connect()
                break
            except ConnectionLost as exc:
                last = exc
            except GenerationError as exc:
                if exc.code is not None:  # refused for a reason (auth, vocabulary): not transient
                    raise
                last = exc
            await self._close_transport()
            await asyncio.sleep(self.resume.delay(attempt + 1))
        else:
            raise ConnectionLost(
                f"the verifier did not come back after {self.resume.attempts} attempts: {last}"
            )
        if old is not None and (w.model_id, w.vocab_fingerprint) != (old.model_id, old.vocab_fingerprint):
            raise GenerationError(
                f"the verifier came back with another model ({w.model_id}, was {old.model_id}) or "
                "vocabulary: the generation cannot go on exactly",
                ErrorCode.VOCAB_MISMATCH,
                "model_id",
            )
        self.resumes.append(time.perf_counter() - t0)

    async def connect(self) -> Welcome:
        """Open the session: hello, then the server's welcome (or a clear refusal). A verifier of
        an earlier release refuses a hello naming `features` (an unknown field to its strict
        decoder): the client then opens the session again without them (it does without the
        optional fields, PROTOCOL.md section 10)."""
        try:
            return await self._connect(FEATURES)
        except GenerationError as exc:
            if not (exc.code is ErrorCode.BAD_MESSAGE and exc.field == "features"):
                raise
        return await self._connect(())

    async def _connect(self, features: tuple[str, ...]) -> Welcome:
        if self._transport_factory is not None:
            inner = await self._transport_factory()
        else:
            try:
                inner = await WebSocketTransport.connect(
                    self.server,
                    self.api_key,
                    open_timeout=self.timeouts.welcome_s,
                    close_timeout=self.timeouts.close_s,
                    ca_file=self.ca_file,
                )
            except ValueError as exc:  # a bad URL
                raise GenerationError(f"cannot reach the verifier at {self.server}: {exc}") from exc
            except Exception as exc:  # refused, unreachable, bad certificate, a failed handshake
                raise ConnectionLost(f"cannot reach the verifier at {self.server}: {exc}") from exc
        self._transport = ShapedTransport(inner, self.link) if self.link is not None else inner
        fp = self.vocab_fingerprint()
        try:
            await self.send(
                self.proto.hello(
                    Hello(
                        vocab_fingerprint=fp,
                        api_key=self.api_key,
                        client="edge-client/0.1",
                        features=features,
                    )
                )
            )
            try:
                async with asyncio.timeout(self.timeouts.welcome_s):  # (a cancel is never lost)
                    msg = await self.recv()
            except TimeoutError:
                raise VerifierTimeout(
                    f"no welcome from the verifier at {self.server} within {self.timeouts.welcome_s:g} s "
                    "of the hello",
                    "welcome",
                ) from None
            if isinstance(msg, Error):
                raise self.refused(msg)
            if not isinstance(msg, Welcome):
                raise ProtocolViolation(
                    f"expected welcome, got {msg.TYPE.value}", ErrorCode.BAD_ORDER, "type"
                )
            check_welcome(msg, fp)
        except BaseException:
            await self._close_transport()
            self.proto = ClientProtocol()
            raise
        self.welcome = msg
        return msg

    async def _close_transport(self) -> None:
        """Close the transport, waiting at most Timeouts.close_s for the closing handshake."""
        transport, self._transport = self._transport, None
        if transport is None:
            return
        try:
            await asyncio.wait_for(transport.close(), self.timeouts.close_s)
        except (Exception, asyncio.CancelledError):  # a peer that never closes: given up on
            pass

    async def drop_connection(self) -> None:
        """Give the connection up (the verifier broke the protocol, stopped answering, or closed):
        the next generation opens a new session; its context is kept for a `continue` prompt."""
        if self.welcome is not None or self._transport is not None:
            self._lost_context = self.proto.context or self._lost_context
        if self._transport is not None and self.proto.state not in (ClientState.CLOSED, ClientState.START):
            with contextlib.suppress(GenerationError, ProtocolError):
                await asyncio.wait_for(self.send(self.proto.close()), self.timeouts.close_s)
        await self._close_transport()
        self.welcome, self.proto = None, ClientProtocol()

    async def close(self) -> None:
        if self._transport is not None:
            if self.proto.state not in (ClientState.CLOSED, ClientState.START):
                try:
                    await asyncio.wait_for(self.send(self.proto.close()), self.timeouts.close_s)
                except (GenerationError, ProtocolError, TimeoutError):
                    pass
            await self._close_transport()

    async def __aenter__(self) -> Self:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def send(self, frame: bytes) -> None:
        if self._transport is None:
            raise GenerationError("not connected: call connect() first")
        try:
            await self._transport.send(frame)
        except TransportClosed as exc:
            raise _closed(exc) from exc

    async def recv(self) -> Any:
        """The next frame, decoded and checked against the session (ClientProtocol.receive). A frame
        that breaks the protocol raises ProtocolViolation; the verifier's `close` ends the session."""
        if self._transport is None:
            raise GenerationError("not connected: call connect() first")
        try:
            data = await self._transport.recv()
            # decoded on arrival; the speculation core acknowledges each frame when it takes it up
            # (ClientProtocol.acknowledge), which moves the protocol's in-flight marker
            msg = self.proto.receive(data, acknowledge=False)
        except TransportClosed as exc:
            raise _closed(exc) from exc
        except ProtocolError as exc:
            raise ProtocolViolation(f"the verifier broke the protocol: {exc}", exc.code, exc.field) from exc
        if isinstance(msg, Close):
            raise GenerationError(f"the verifier closed the session: {msg.reason or 'no reason given'}")
        return msg

    def refused(self, e: Error) -> GenerationError:
        where = f" (field {e.field})" if e.field else ""
        return GenerationError(f"verifier refused: {e.code.value}{where}: {e.message}", e.code, e.field)

    def next_round(self) -> int:
        return self.proto.last_round + 1


# ---------------------------------------------------------------------------------------------------
# The transports: a WebSocket, and an in-process network shaper


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


__all__ = [
    "RESUMABLE_CLOSES",
    "ConnectionLost",
    "GenerationError",
    "ProtocolViolation",
    "ResumeConfig",
    "Session",
    "Timeouts",
    "VerifierTimeout",
    "check_welcome",
]
