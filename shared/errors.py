"""The protocol's error type, its error codes and the WebSocket close codes.

Every check in `shared/` (and the verifier's input checks) raises `ProtocolError`, naming the field
that was wrong, so a transport can turn it into an `error{code, field, message, fatal}` frame and,
when fatal, a close code.
"""

from __future__ import annotations

import enum


class ErrorCode(str, enum.Enum):
    """Error codes carried in `error.code`."""

    BAD_FRAME = "BAD_FRAME"  # not a msgpack map, trailing bytes, extension types, too deep
    BAD_MESSAGE = "BAD_MESSAGE"  # a field missing, of the wrong type or out of its range
    UNKNOWN_TYPE = "UNKNOWN_TYPE"  # `type` names no message of this protocol
    TOO_LARGE = "TOO_LARGE"  # a frame over max_bytes
    BAD_VERSION = "BAD_VERSION"  # hello.version is not spoken by the peer
    VOCAB_MISMATCH = "VOCAB_MISMATCH"  # the drafter's vocabulary is not the target's
    UNAUTHORIZED = "UNAUTHORIZED"  # missing or unknown API key
    MODE_NOT_ALLOWED = "MODE_NOT_ALLOWED"  # mss/rrs for an untrusted key
    OUT_OF_RANGE = "OUT_OF_RANGE"  # a token id outside [0, vocab_size)
    BAD_TREE = "BAD_TREE"  # parent not earlier, siblings repeated, draws inconsistent
    LIMIT_EXCEEDED = "LIMIT_EXCEEDED"  # a tree over max_nodes / max_depth, a list over its limit
    BAD_DISTRIBUTION = "BAD_DISTRIBUTION"  # a q row that is not a finite distribution, zero-mass draw
    BAD_ORDER = "BAD_ORDER"  # a message not legal in the current state, a round id out of order
    TOO_MANY_PENDING = "TOO_MANY_PENDING"  # one tree more than max_pending
    CONTEXT_FULL = "CONTEXT_FULL"  # prompt (plus cached context) over max_context
    BUSY = "BUSY"  # the server is at max_sessions or out of KV blocks
    RATE_LIMITED = "RATE_LIMITED"  # the key's tokens per minute are spent: retry later
    INTERNAL = "INTERNAL"  # a bug on the sending side


class CloseCode(enum.IntEnum):
    """WebSocket close codes (RFC 6455 section 7.4.1) used by the service."""

    NORMAL = 1000
    GOING_AWAY = 1001
    INVALID_DATA = 1007
    POLICY_VIOLATION = 1008
    MESSAGE_TOO_BIG = 1009
    INTERNAL_ERROR = 1011
    TRY_AGAIN_LATER = 1013


# How a fatal error closes the connection.
CLOSE_FOR_ERROR: dict[ErrorCode, CloseCode] = {
    ErrorCode.TOO_LARGE: CloseCode.MESSAGE_TOO_BIG,
    ErrorCode.BAD_VERSION: CloseCode.POLICY_VIOLATION,
    ErrorCode.VOCAB_MISMATCH: CloseCode.POLICY_VIOLATION,
    ErrorCode.UNAUTHORIZED: CloseCode.POLICY_VIOLATION,
    ErrorCode.BUSY: CloseCode.TRY_AGAIN_LATER,
    ErrorCode.INTERNAL: CloseCode.INTERNAL_ERROR,
}


def close_code_for(code: ErrorCode) -> CloseCode:
    """The close code that ends a connection after a fatal error with this code."""
    return CLOSE_FOR_ERROR.get(code, CloseCode.INVALID_DATA)


class ProtocolError(Exception):
    """A message, tree or distribution broke the protocol.

    `field` names what was wrong (a dotted path such as `tree.parents`), `fatal` says whether the
    connection must end, and `round` ties the error to a tree round (0: the prompt) when it has one.
    """

    def __init__(
        self,
        code: ErrorCode,
        message: str,
        field: str | None = None,
        *,
        fatal: bool = False,
        round: int | None = None,
    ) -> None:
        super().__init__(f"{code.value}{f' [{field}]' if field else ''}: {message}")
        self.code = code
        self.field = field
        self.message = message
        self.fatal = fatal
        self.round = round

    @property
    def close_code(self) -> CloseCode:
        return close_code_for(self.code)
