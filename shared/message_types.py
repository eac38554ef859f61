"""The protocol version, the message types and the verification modes of the wire protocol."""

from __future__ import annotations

import enum

PROTOCOL_VERSION = 1


class MsgType(str, enum.Enum):
    HELLO = "hello"
    WELCOME = "welcome"
    PROMPT = "prompt"
    TREE = "tree"
    VERDICT = "verdict"
    STALE = "stale"
    ERROR = "error"
    CANCEL = "cancel"
    CLOSE = "close"


class Mode(str, enum.Enum):
    """Verification modes. `ar` is target-only decoding (the cloud-only baseline)."""

    GREEDY = "greedy"
    MATCH = "match"
    MSS = "mss"
    RRS = "rrs"
    AR = "ar"

    @property
    def stochastic(self) -> bool:
        """Whether trees in this mode carry draws and q rows."""
        return self in (Mode.MSS, Mode.RRS)
