"""The edge's session with the verifier: connect, send and receive frames, resume after a drop.

`Session` owns the transport and the client's `shared.protocol.ClientProtocol`; on a dropped
connection (ConnectionLost) it reconnects with backoff, round robin over the replica URLs, and
checks that the verifier came back with the same model and vocabulary. EdgeClient
(edge_client.client) adds drafting, generation and text on top.

Under it: the byte transports (edge_client.transports); the errors a generation ends with
(edge_client.errors, re-exported here). A `link` (bench.shaper.LinkShape) emulates a network link
between the session and its transport, which is what tests use; benches can also put a real TCP
delay proxy (`python -m bench.netproxy`) between the client and the verifier.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import re
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Self

from edge_client.errors import (
    RESUMABLE_CLOSES,
    ConnectionLost,
    GenerationError,
    ProtocolViolation,
    VerifierTimeout,
)
from edge_client.transports import Link, Transport, TransportClosed, WebSocketTransport
from shared.errors import ErrorCode, ProtocolError
from shared.messages import FEATURE_RESUME, FEATURES, PROTOCOL_VERSION, Close, Error, Hello, Welcome
from shared.protocol import ClientProtocol, ClientState

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
        return ConnectionLost(message, exc.code)
    return GenerationError(message)


# the longest wait to open a connection to a verifier's own address (welcome.direct) before the
# session stays where it is (an address on a network the client cannot reach may never answer)
MOVE_OPEN_S = 3.0

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
    link:      wraps the transport, e.g. an emulated network link (bench.shaper.LinkShape: one-way
               delays, jitter, bandwidth)
    transport: an async factory of the byte transport (default: a WebSocket to `server`)
    resume:    reconnect when the connection drops (True: ResumeConfig defaults; False: never)
    timeouts:  how long to wait for the verifier (Timeouts defaults)
    """

    def __init__(
        self,
        server: str | Sequence[str],
        *,
        api_key: str | None = None,
        link: Link | None = None,
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
        # the resume token of the session a reconnect resumes (its welcome's): the verifier that
        # kept that session's KV cache prefills only what it lacks
        self._resume_token: str | None = None
        # a session moved to its verifier's own address (welcome.direct): the connection it was
        # opened on, kept open and idle until the session ends (the fleet's proxy counts it)
        self._lease: Transport | None = None
        self.moves = 0  # sessions moved to their verifier's own address

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
        self._resume_token = old.resume if old is not None else None
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
            self._resume_token = None
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
        self._resume_token = None  # (claimed by the first session that named it, or gone)
        self.resumes.append(time.perf_counter() - t0)

    async def connect(self) -> Welcome:
        """Open the session: hello, then the server's welcome (or a clear refusal). A verifier of
        an earlier release refuses a hello naming `features` (an unknown field to its strict
        decoder): the client then opens the session again without them (it does without the
        optional fields, PROTOCOL.md section 10)."""
        try:
            w = await self._connect(FEATURES)
        except GenerationError as exc:
            if not (exc.code is ErrorCode.BAD_MESSAGE and exc.field == "features"):
                raise
            return await self._connect(())
        offered = w.direct is not None and w.direct != self.server and w.resume is not None
        # never from wss:// to ws://: the hello there would carry the API key in the clear
        offered = offered and not (
            self.server.startswith("wss://") and not str(w.direct).startswith("wss://")
        )
        if offered and self._transport_factory is None:
            return await self._move(w)
        return w

    async def _move(self, w: Welcome) -> Welcome:
        """Take the session to the verifier's own address (`w.direct`, a fleet replica's): a hello
        there naming the session's resume token carries it on over that connection, past the
        fleet's proxy, and the first connection stays open, idle, until the session ends. Any
        failure (the address unreachable from here, the offer gone) keeps the session where it is."""
        assert w.direct is not None
        first, first_proto = self._transport, self.proto
        self._transport, self.proto = None, ClientProtocol()
        try:
            moved = await self._connect(FEATURES, url=w.direct, resume=w.resume, open_s=MOVE_OPEN_S)
        except (GenerationError, ProtocolError, OSError):
            moved = None
        if moved is not None and moved.session_id != w.session_id:  # a session of its own there
            await self.close()
            moved = None
        if moved is None:
            self._transport, self.proto, self.welcome = first, first_proto, w
            return w
        self._lease = first
        self.moves += 1
        return moved

    async def connect_when_room(self) -> Welcome:
        """`connect`, and with `resume`, again after the resume backoff (up to its attempts) while
        the verifier says "try again later" (close 1013: at its session cap, or draining; or a
        fleet's proxy refused the upgrade with 503 or 500, its queue full); any other failure, and
        every one without `resume`, is raised at once."""
        tries = 0
        while True:
            try:
                return await self.connect()
            except ConnectionLost as exc:
                tries += 1
                if self.resume is None or not exc.try_again_later or tries >= self.resume.attempts:
                    raise
            await asyncio.sleep(self.resume.delay(tries))

    async def _connect(
        self,
        features: tuple[str, ...],
        url: str | None = None,
        resume: str | None = None,
        open_s: float | None = None,
    ) -> Welcome:
        """Open a session at `url` (the server in use if None), its hello naming `resume` (the
        token of a dropped session if None), the connection opened within `open_s` (default:
        Timeouts.welcome_s)."""
        url = url or self.server
        resume = resume or self._resume_token
        if self._transport_factory is not None:
            inner = await self._transport_factory()
        else:
            try:
                inner = await WebSocketTransport.connect(
                    url,
                    self.api_key,
                    open_timeout=open_s or self.timeouts.welcome_s,
                    close_timeout=self.timeouts.close_s,
                    ca_file=self.ca_file if url.startswith("wss://") else None,
                    session_id=self._resume_token,
                )
            except ValueError as exc:  # a bad URL
                raise GenerationError(f"cannot reach the verifier at {url}: {exc}") from exc
            except Exception as exc:  # refused, unreachable, bad certificate, a failed handshake
                status = getattr(getattr(exc, "response", None), "status_code", None)
                raise ConnectionLost(
                    f"cannot reach the verifier at {url}: {exc}",
                    http_status=status if isinstance(status, int) else None,
                ) from exc
        self._transport = self.link.wrap(inner) if self.link is not None else inner
        fp = self.vocab_fingerprint()
        try:
            await self.send(
                self.proto.hello(
                    Hello(
                        vocab_fingerprint=fp,
                        api_key=self.api_key,
                        client="edge-client/0.1",
                        features=features,
                        resume=resume if FEATURE_RESUME in features else None,
                    )
                )
            )
            try:
                async with asyncio.timeout(self.timeouts.welcome_s):  # (a cancel is never lost)
                    msg = await self.recv()
            except TimeoutError:
                raise VerifierTimeout(
                    f"no welcome from the verifier at {url} within {self.timeouts.welcome_s:g} s "
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
        """Close the transport (and a moved session's first connection), waiting at most
        Timeouts.close_s for the closing handshakes."""
        transports = [t for t in (self._transport, self._lease) if t is not None]
        self._transport = self._lease = None
        if not transports:
            return
        try:
            await asyncio.wait_for(asyncio.gather(*(t.close() for t in transports)), self.timeouts.close_s)
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
