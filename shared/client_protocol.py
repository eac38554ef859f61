"""The session protocol's client side, sans I/O (shared/protocol.py has the rules): checks the
server's frames against what the client sent and tracks the committed sequence it reports."""

from __future__ import annotations

import enum

from shared.errors import ErrorCode, ProtocolError
from shared.matching import tree_matches
from shared.messages import (
    DEFAULT_WIRE_LIMITS,
    Cancel,
    Close,
    Error,
    FrameStats,
    Hello,
    Message,
    Mode,
    Prompt,
    Stale,
    Tree,
    Verdict,
    Welcome,
    WireLimits,
    decode,
    encode,
)

# ---------------------------------------------------------------------------------------------------
# Client side


class ClientState(enum.Enum):
    START = "start"
    AWAIT_WELCOME = "await_welcome"
    IDLE = "idle"
    GENERATING = "generating"
    CANCELLING = "cancelling"
    CLOSED = "closed"


class ClientProtocol:
    """One connection, client side: checks the server's frames against what the client sent.

    `committed` is the committed sequence as the server reported it (prompt + accepted tokens).
    """

    def __init__(self, wire: WireLimits = DEFAULT_WIRE_LIMITS) -> None:
        self.wire = wire
        self.state = ClientState.START
        self.welcome_msg: Welcome | None = None
        self.committed: list[int] = []
        self.mode: Mode = Mode.GREEDY
        self.outstanding: set[int] = set()  # tree rounds sent, not yet answered
        self.awaiting_prompt = False
        self.last_round = 0
        self.last_verdict_round = 0
        self.in_flight: int | None = None  # the round the server is verifying, as far as we know
        self.stats = FrameStats()
        self._context: list[int] = []

    def _send(self, msg: Message) -> bytes:
        frame = encode(msg)
        if self.welcome_msg is not None and len(frame) > self.welcome_msg.limits.max_bytes:
            raise ProtocolError(
                ErrorCode.TOO_LARGE,
                f"{msg.TYPE.value} of {len(frame)} bytes is over the server's limit "
                f"{self.welcome_msg.limits.max_bytes}",
                "frame",
            )
        self.stats.out(msg.TYPE.value, len(frame))
        return frame

    def _require(self, *states: ClientState) -> None:
        if self.state not in states:
            raise ProtocolError(ErrorCode.BAD_ORDER, f"not allowed in state {self.state.value}", "state")

    # -- outgoing
    def hello(self, msg: Hello) -> bytes:
        self._require(ClientState.START)
        self.state = ClientState.AWAIT_WELCOME
        return self._send(msg)

    def prompt(self, msg: Prompt) -> bytes:
        self._require(ClientState.IDLE)
        frame = self._send(msg)
        self.mode = msg.mode
        self.committed = self.committed_for(msg)
        self.awaiting_prompt = True
        self.in_flight = 0
        self.state = ClientState.GENERATING
        return frame

    def committed_for(self, msg: Prompt) -> list[int]:
        """The committed sequence a prompt starts from: the context if it continues, then its tokens."""
        return (list(self._context) if msg.continue_ else []) + [int(t) for t in msg.tokens]

    def tree(self, msg: Tree) -> bytes:
        self._require(ClientState.GENERATING)
        if self.mode is Mode.AR:
            raise ProtocolError(ErrorCode.BAD_ORDER, "mode ar takes no trees", "round")
        if msg.round <= self.last_round:
            raise ProtocolError(
                ErrorCode.BAD_ORDER, f"round {msg.round} is not after {self.last_round}", "round"
            )
        w = self.welcome_msg
        if w is not None and len(self.outstanding) >= w.limits.max_pending + 1:
            raise ProtocolError(
                ErrorCode.TOO_MANY_PENDING, f"{len(self.outstanding)} trees already outstanding", "round"
            )
        frame = self._send(msg)
        self.last_round = msg.round
        self.outstanding.add(msg.round)
        if self.in_flight is None and tree_matches(msg.tree, self.committed):
            self.in_flight = msg.round
        return frame

    def cancel(self) -> bytes:
        self._require(ClientState.GENERATING)
        self.state = ClientState.CANCELLING
        return self._send(Cancel())

    def close(self, reason: str | None = None) -> bytes:
        frame = self._send(Close(reason))
        self.state = ClientState.CLOSED
        return frame

    # -- incoming
    def receive(self, data: bytes) -> Message:
        """Decode and check one server frame; raises ProtocolError if the server broke the protocol."""
        self.stats.inc(len(data))
        msg = decode(data, self.wire)
        if isinstance(msg, Error):
            self._on_error(msg)
            return msg
        if isinstance(msg, Close):
            self.state = ClientState.CLOSED
            return msg
        if isinstance(msg, Welcome):
            self._require(ClientState.AWAIT_WELCOME)
            self.welcome_msg = msg
            self.state = ClientState.IDLE
            return msg
        if isinstance(msg, Verdict):
            self._on_verdict(msg)
            return msg
        if isinstance(msg, Stale):
            if msg.round not in self.outstanding:
                raise ProtocolError(ErrorCode.BAD_ORDER, f"stale for round {msg.round} never sent", "round")
            self.outstanding.discard(msg.round)
            return msg
        raise ProtocolError(ErrorCode.BAD_ORDER, f"a server may not send {msg.TYPE.value}", "type")

    def _on_error(self, e: Error) -> None:
        if e.fatal:
            self.state = ClientState.CLOSED
            return
        if e.code is ErrorCode.BUSY and e.round is not None and self.state is not ClientState.IDLE:
            # the server could not verify a round (ServerProtocol.abort): the generation is over
            self._context = list(self.committed)
            self.awaiting_prompt = False
            self.outstanding.clear()
            self.in_flight = None
            self.state = ClientState.IDLE
        elif e.round == 0 and self.awaiting_prompt:
            self.awaiting_prompt = False
            self.in_flight = None
            self.state = ClientState.IDLE
        elif e.round is not None:
            self.outstanding.discard(e.round)
            if self.in_flight == e.round:
                self.in_flight = None

    def _on_verdict(self, v: Verdict) -> None:
        self._require(ClientState.GENERATING, ClientState.CANCELLING)
        if v.round == 0:
            legal = self.awaiting_prompt or self.mode is Mode.AR or self.state is ClientState.CANCELLING
            if not legal:
                raise ProtocolError(ErrorCode.BAD_ORDER, "unexpected round-0 verdict", "round")
            self.awaiting_prompt = False
        else:
            if v.round not in self.outstanding or v.round <= self.last_verdict_round:
                raise ProtocolError(
                    ErrorCode.BAD_ORDER, f"verdict for round {v.round} not outstanding", "round"
                )
            self.outstanding.discard(v.round)
            self.last_verdict_round = v.round
        self.committed.extend(int(t) for t in v.tokens)
        if v.committed_len != len(self.committed):
            raise ProtocolError(
                ErrorCode.BAD_MESSAGE,
                f"committed_len {v.committed_len} but the client holds {len(self.committed)} tokens",
                "committed_len",
            )
        if v.next_round is not None and v.next_round not in self.outstanding:
            raise ProtocolError(
                ErrorCode.BAD_ORDER, f"next_round {v.next_round} was never sent", "next_round"
            )
        self.in_flight = v.next_round
        if v.done:
            self._context = list(self.committed)
            self.in_flight = None
            self.state = ClientState.IDLE
        elif self.mode is Mode.AR:
            self.in_flight = 0
