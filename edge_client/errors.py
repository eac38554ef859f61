"""The errors a generation ends with on the edge (EdgeClient, Session): the verifier refused the
request or the session broke, and which of those a new session may resume from.
"""

from __future__ import annotations

from shared.errors import ErrorCode


class GenerationError(RuntimeError):
    """The verifier refused the request or the session broke; `code`/`field` say what was wrong."""

    def __init__(self, message: str, code: ErrorCode | None = None, field: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.field = field


class ConnectionLost(GenerationError):
    """The connection to the verifier dropped (reset, restart, draining, overload): a generation can
    resume on a new session. A close for a reason of the protocol (1002, 1007, 1008, 1009) is not this.
    `close_code`: the WebSocket close code that ended it, where one did (1013: try again later).
    `http_status`: the HTTP status that refused the WebSocket upgrade, where one did (a fleet's
    proxy past its queue answers 503, or 500)."""

    def __init__(self, message: str, close_code: int | None = None, http_status: int | None = None) -> None:
        super().__init__(message)
        self.close_code = close_code
        self.http_status = http_status

    @property
    def try_again_later(self) -> bool:
        """The verifier had no room for the session (1013, or an upgrade refused with 503 or 500):
        the same request may succeed after a wait."""
        return self.close_code == 1013 or self.http_status in (500, 503)


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


__all__ = ["RESUMABLE_CLOSES", "ConnectionLost", "GenerationError", "ProtocolViolation", "VerifierTimeout"]
