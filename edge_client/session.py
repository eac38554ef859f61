"""The edge's session with the verifier: connect, send and receive frames, resume after a drop.

`Session` owns the transport and the client's `shared.protocol.ClientProtocol`; on a dropped
connection (ConnectionLost) it reconnects with backoff, round robin over the replica URLs, and
checks that the verifier came back with the same model and vocabulary. EdgeClient
(edge_client.client) adds drafting, generation and text on top.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Self

from edge_client.transport import LinkShape, ShapedTransport, Transport, TransportClosed, WebSocketTransport
from shared.errors import ErrorCode, ProtocolError
from shared.messages import Error, Hello, Welcome
from shared.protocol import ClientProtocol, ClientState


class GenerationError(RuntimeError):
    """The verifier refused the request or the session broke; `code`/`field` say what was wrong."""

    def __init__(self, message: str, code: ErrorCode | None = None, field: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.field = field


class ConnectionLost(GenerationError):
    """The connection to the verifier dropped (reset, restart, draining, overload): a generation can
    resume on a new session. A close for a reason of the protocol (1007, 1008, 1009) is not this."""


# close codes after which the same request may succeed on a new session (None: no close frame)
RESUMABLE_CLOSES = (None, 1001, 1006, 1011, 1012, 1013)


def _closed(exc: TransportClosed) -> GenerationError:
    message = f"the verifier closed the connection: {exc.reason or exc.code}"
    return ConnectionLost(message) if exc.code in RESUMABLE_CLOSES else GenerationError(message)


@dataclass(frozen=True)
class ResumeConfig:
    """Reconnecting after the connection drops (EdgeClient(resume=...)).

    attempts:  connection attempts per drop (each tries the next server URL, round robin)
    backoff_s: the first wait between attempts, doubled each time up to max_backoff_s
    """

    attempts: int = 10
    backoff_s: float = 0.2
    max_backoff_s: float = 5.0

    def __post_init__(self) -> None:
        if self.attempts < 1 or not self.backoff_s >= 0 or not self.max_backoff_s >= self.backoff_s:
            raise ValueError("need attempts >= 1 and 0 <= backoff_s <= max_backoff_s")


class Session:
    """One session with the verifier at a time (see the module docstring).

    server:    a URL, or several (replicas with no shared state): a dropped connection fails over
    api_key:   sent in the hello
    link:      emulate a network link in-process (one-way delays, jitter, bandwidth)
    transport: an async factory of the byte transport (default: a WebSocket to `server`)
    resume:    reconnect when the connection drops (True: ResumeConfig defaults; False: never)
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
    ) -> None:
        self.servers = [server] if isinstance(server, str) else list(server)
        if not self.servers:
            raise ValueError("EdgeClient needs at least one verifier URL")
        self._server_i = 0
        self.resume: ResumeConfig | None = (
            resume if isinstance(resume, ResumeConfig) else (ResumeConfig() if resume else None)
        )
        self.resumes: list[float] = []  # seconds each resume took (drop to the new session's welcome)
        self.ca_file = ca_file
        self.api_key = api_key
        self.link = link
        self._transport_factory = transport
        self._transport: Transport | None = None
        self.proto = ClientProtocol()
        self.welcome: Welcome | None = None

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
        if self._transport is not None:
            with contextlib.suppress(Exception):
                await self._transport.close()
        self._transport, self.welcome, self.proto = None, None, ClientProtocol()
        delay = self.resume.backoff_s
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
            if self._transport is not None:
                with contextlib.suppress(Exception):
                    await self._transport.close()
            self._transport = None
            await asyncio.sleep(delay)
            delay = min(delay * 2, self.resume.max_backoff_s)
        else:
            raise GenerationError(
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
        """Open the session: hello, then the server's welcome (or a clear refusal)."""
        if self._transport_factory is not None:
            inner = await self._transport_factory()
        else:
            try:
                inner = await WebSocketTransport.connect(self.server, self.api_key, ca_file=self.ca_file)
            except ValueError as exc:  # a bad URL
                raise GenerationError(f"cannot reach the verifier at {self.server}: {exc}") from exc
            except Exception as exc:  # refused, unreachable, bad certificate, a failed handshake
                raise ConnectionLost(f"cannot reach the verifier at {self.server}: {exc}") from exc
        self._transport = ShapedTransport(inner, self.link) if self.link is not None else inner
        fp = self.vocab_fingerprint()
        await self.send(
            self.proto.hello(Hello(vocab_fingerprint=fp, api_key=self.api_key, client="edge-client/0.1"))
        )
        msg = await self.recv()
        if isinstance(msg, Error):
            raise self.refused(msg)
        if not isinstance(msg, Welcome):
            raise GenerationError(f"expected welcome, got {msg.TYPE.value}")
        if msg.vocab_fingerprint and msg.vocab_fingerprint != fp:
            raise GenerationError(
                f"vocabulary mismatch: the draft model's tokenizer is not the target's ({msg.model_id}); "
                "use a draft model built on the target's vocabulary",
                ErrorCode.VOCAB_MISMATCH,
                "vocab_fingerprint",
            )
        self.welcome = msg
        return msg

    async def close(self) -> None:
        if self._transport is not None:
            if self.proto.state not in (ClientState.CLOSED, ClientState.START):
                try:
                    await self.send(self.proto.close())
                except (GenerationError, ProtocolError):
                    pass
            await self._transport.close()
            self._transport = None

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
        if self._transport is None:
            raise GenerationError("not connected: call connect() first")
        try:
            data = await self._transport.recv()
        except TransportClosed as exc:
            raise _closed(exc) from exc
        # decoded on arrival; the speculation core acknowledges each frame when it takes it up
        # (ClientProtocol.acknowledge), which moves the protocol's in-flight marker
        return self.proto.receive(data, acknowledge=False)

    def refused(self, e: Error) -> GenerationError:
        where = f" (field {e.field})" if e.field else ""
        return GenerationError(f"verifier refused: {e.code.value}{where}: {e.message}", e.code, e.field)

    def next_round(self) -> int:
        return self.proto.last_round + 1


__all__ = ["RESUMABLE_CLOSES", "ConnectionLost", "GenerationError", "ResumeConfig", "Session"]
