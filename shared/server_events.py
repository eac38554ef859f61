"""What the server side of the session protocol tells its caller (server_protocol.py): its state
and the events that `ServerProtocol.receive` returns."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np

from shared.errors import CloseCode, ProtocolError
from shared.messages import (
    Hello,
    Prompt,
)
from shared.tree import TokenTree


class ServerState(enum.Enum):
    AWAIT_HELLO = "await_hello"
    IDLE = "idle"  # welcomed, no generation active
    GENERATING = "generating"
    CLOSED = "closed"


@dataclass(frozen=True)
class HelloReceived:
    hello: Hello


@dataclass(frozen=True)
class PromptReceived:
    """Start prefill. `committed` is the full committed sequence (cached context + new tokens)."""

    prompt: Prompt
    committed: np.ndarray


@dataclass(frozen=True)
class VerifyTree:
    """Verify this tree now (it matches the committed sequence and nothing else is in flight);
    tree None: the next step of a stream round (one token from row 0 alone), `continues` when an
    earlier verdict of the same round went out."""

    round: int
    tree: TokenTree | None
    continues: bool = False


@dataclass(frozen=True)
class CancelReceived:
    in_flight: bool  # a round is being verified; its verdict will end the generation


@dataclass(frozen=True)
class ClosedByPeer:
    reason: str | None


@dataclass(frozen=True)
class ErrorSent:
    """An error frame is in the outbox; if fatal, close with `close_code` after sending it."""

    error: ProtocolError

    @property
    def close_code(self) -> CloseCode:
        return self.error.close_code


ServerEvent = HelloReceived | PromptReceived | VerifyTree | CancelReceived | ClosedByPeer | ErrorSent
