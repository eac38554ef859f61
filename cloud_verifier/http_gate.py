"""The gate in front of every HTTP route (ASGI middleware; WebSockets pass through: their key is
checked at hello).

- Keys: with a key file, every HTTP request needs a key except the probes `OPEN_PATHS` (load
  balancers and Prometheus); that covers the API docs and schema FastAPI adds (/docs, /redoc,
  /openapi.json) and paths that do not exist (401, not 404: no route is revealed without a key).
- Drain: a request that arrives while the server drains gets 503 saying so. The requests in flight
  are counted (`AppState.http_running`) so that the drain waits for them; those still running when
  it sets `AppState.http_cut` (its deadline) are stopped and answered: a stream that has begun ends
  with an error event and `data: [DONE]`, a response not yet begun is a 503.

- Load: at most `max_http_requests(config)` HTTP requests are in flight (the generations the
  server runs and queues, and a few more reading their bodies or answering /v1/models); one more
  is 503 with Retry-After before its body is read, so bodies held in memory are bounded too
  (each at most MAX_BODY_BYTES).

Error bodies are OpenAI's (`{"error": {"message", "type", "param", "code"}}`), as on /v1.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cloud_verifier.app_state import AppState
from cloud_verifier.auth import AuthError
from cloud_verifier.server_config import ServerConfig
from shared.openai_compat import SSE_DONE, ApiError

# answered without a key and during a drain: health probes and metrics scrapes
OPEN_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})


HTTP_SLACK = 16  # requests beyond the generations' slots and queue: reading bodies, /v1/models


def max_http_requests(config: ServerConfig) -> int:
    return config.max_sessions + config.max_waiting + HTTP_SLACK


class HttpGate:
    def __init__(self, app: ASGIApp, state: AppState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        state = self.state
        if state.draining:
            why = "the verifier is draining (shutting down): send this request to another replica"
            await _respond(send, ApiError(503, why, None, "draining", "server_error", {"Retry-After": "5"}))
            return
        try:
            state.keys.authenticate(_bearer(scope))
        except AuthError as exc:
            await _respond(send, ApiError(401, str(exc), None, "invalid_api_key"))
            return
        limit = max_http_requests(state.config)
        if state.http_running >= limit:
            why = f"the verifier has {limit} HTTP requests in flight: retry shortly or use another replica"
            await _respond(send, ApiError(503, why, None, "overloaded", "server_error", {"Retry-After": "1"}))
            return
        state.http_running += 1
        try:
            await self._until_cut(scope, receive, send)
        finally:
            state.http_running -= 1

    async def _until_cut(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Run the route; if the drain's deadline comes first, stop it and end the response."""
        start: dict[str, Any] = {}
        ended = False
        cut = False

        async def watched(message: Message) -> None:
            nonlocal ended
            if cut:  # the route was stopped: its response is ours to end
                raise asyncio.CancelledError
            if message["type"] == "http.response.start":
                start.update(message)
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                ended = True
            await send(message)

        route = asyncio.ensure_future(self.app(scope, receive, watched))
        deadline = asyncio.ensure_future(self.state.http_cut.wait())
        try:
            await asyncio.wait({route, deadline}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # this request's task is cancelled: so is the route
            route.cancel()
            raise
        finally:
            deadline.cancel()
        if route.done():
            route.result()
            return
        cut = True
        route.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await route
        if ended:
            return
        why = (
            f"the verifier is shutting down: the generation did not finish within the "
            f"{self.state.config.drain_timeout_s:g} s drain"
        )
        err = ApiError(503, why, None, "shutting_down", "server_error")
        if not start:
            await _respond(send, err)
        elif _header(start, b"content-type").startswith(b"text/event-stream"):
            event = f"data: {json.dumps(err.body())}\n\n".encode()
            await send({"type": "http.response.body", "body": event + SSE_DONE, "more_body": False})
        else:
            await send({"type": "http.response.body", "body": b"", "more_body": False})


def _bearer(scope: Scope) -> str | None:
    auth = _header(scope, b"authorization").decode("latin-1")
    return auth[7:].strip() if auth.lower().startswith("bearer ") else None


def _header(message: Scope | dict[str, Any], name: bytes) -> bytes:
    for k, v in message.get("headers", ()):
        if k.lower() == name:
            return bytes(v)
    return b""


async def _respond(send: Send, err: ApiError) -> None:
    body = json.dumps(err.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in (err.headers or {}).items()]
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})
