"""Protocol messages as typed dataclasses, and their msgpack codec (PROTOCOL.md sections 2-3). The
messages are in handshake.py and round_messages.py, their types and modes in message_types.py;
this module has the codec and gathers the public names.

Every frame is one msgpack map with a `type` key. Integer arrays travel as raw little-endian bytes
(msgpack bin): token ids, parents and pointers as int32/uint32, q weights as uint16 holding
`weight - 1`, drafter ids as uint8. Decoding enforces explicit size limits, accepts no extension
types, no duplicate or unknown keys and no non-string keys, and never unpickles anything.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from shared.errors import ErrorCode, ProtocolError
from shared.handshake import Hello, SessionLimits, Welcome
from shared.message_types import PROTOCOL_VERSION, Mode, MsgType
from shared.round_messages import Cancel, Close, Error, Prompt, Stale, Tree, Verdict
from shared.sparse import Q_TOTAL
from shared.wire import (
    DEFAULT_WIRE_LIMITS,
    FrameStats,
    Reader,
    WireLimits,
    pack_frame,
    unpack_frame,
)

Message = Hello | Welcome | Prompt | Tree | Verdict | Stale | Error | Cancel | Close
M = TypeVar("M", bound=Message)

_DECODERS: dict[str, Callable[[Reader], Message]] = {
    MsgType.HELLO.value: Hello.from_wire,
    MsgType.WELCOME.value: Welcome.from_wire,
    MsgType.PROMPT.value: Prompt.from_wire,
    MsgType.TREE.value: Tree.from_wire,
    MsgType.VERDICT.value: Verdict.from_wire,
    MsgType.STALE.value: Stale.from_wire,
    MsgType.ERROR.value: Error.from_wire,
    MsgType.CANCEL.value: Cancel.from_wire,
    MsgType.CLOSE.value: Close.from_wire,
}


# ---------------------------------------------------------------------------------------------------
# Codec


def encode(msg: Message) -> bytes:
    """One frame: a msgpack map with `type` first."""
    d: dict[str, Any] = {"type": msg.TYPE.value}
    d.update(msg.to_wire())
    return pack_frame(d)


def decode(data: bytes, limits: WireLimits = DEFAULT_WIRE_LIMITS) -> Message:
    """Decode one frame or raise ProtocolError (fatal: the stream can no longer be trusted)."""
    r = Reader(unpack_frame(data, limits), "", limits)
    kind = r.raw("type")
    if not isinstance(kind, str) or kind not in _DECODERS:
        raise ProtocolError(
            ErrorCode.UNKNOWN_TYPE,
            f"unknown message type {kind!r}; one of {sorted(_DECODERS)}",
            "type",
            fatal=True,
        )
    msg = _DECODERS[kind](r)
    r.finish()
    return msg


__all__ = [
    "DEFAULT_WIRE_LIMITS",
    "PROTOCOL_VERSION",
    "Q_TOTAL",
    "Cancel",
    "Close",
    "Error",
    "FrameStats",
    "Hello",
    "Message",
    "Mode",
    "MsgType",
    "Prompt",
    "SessionLimits",
    "Stale",
    "Tree",
    "Verdict",
    "Welcome",
    "WireLimits",
    "decode",
    "encode",
]
