"""uvicorn's h11 protocol with a deadline on request headers.

uvicorn times out an idle keep-alive connection, but not a request whose line and headers arrive
slowly or never finish (its keep-alive timer is cancelled by any byte received): a client could hold
connections open forever a byte at a time. Here every connection must complete a request's headers
within HEADER_TIMEOUT_S of opening, and of finishing its previous response; otherwise it is closed.
Header size is bounded separately (uvicorn's h11_max_incomplete_event_size).
"""

from __future__ import annotations

import asyncio
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

HEADER_TIMEOUT_S = 10.0


class DeadlineH11Protocol(H11Protocol):
    header_timeout_s = HEADER_TIMEOUT_S

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm()

    def _arm(self) -> None:
        old: Any = getattr(self, "_header_timer", None)
        if old is not None:
            old.cancel()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._header_timeout)

    def _header_timeout(self) -> None:
        if self.transport.is_closing() or self.transport.get_protocol() is not self:
            return  # closed, or upgraded to a WebSocket
        waiting_for_headers = self.conn.their_state is h11.IDLE and (
            self.cycle is None or self.cycle.response_complete
        )
        if waiting_for_headers:
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        timer: Any = getattr(self, "_header_timer", None)
        if timer is not None:
            timer.cancel()
        super().connection_lost(exc)


def with_header_timeout(seconds: float) -> type[DeadlineH11Protocol]:
    """The protocol class with its own deadline (a subclass per value: uvicorn takes a class)."""
    return type("DeadlineH11Protocol", (DeadlineH11Protocol,), {"header_timeout_s": seconds})
