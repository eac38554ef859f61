"""The HTTP guards of an OpenAI endpoint that spends its user's key (the edge's `edge-client serve`),
so it answers only its own.

- Host must name this endpoint (the bound host or a loopback name): a DNS-rebinding page names its
  own domain. Listening on every interface, any address literal is accepted (it cannot be rebound).
- Origin, when a browser sends one, must be the endpoint's own or one allowed (`allow_origins`;
  those get CORS headers and preflights): else any web page could make the endpoint generate.
- POST bodies must be `Content-Type: application/json` (a form or `text/plain` post needs no CORS
  preflight), at most `max_body_bytes`: refused by Content-Length before anything is read, and a
  chunked body is read as it arrives and no further than the limit (body.read_json).
"""

from __future__ import annotations

import contextlib
import ipaddress
from dataclasses import dataclass
from typing import ClassVar
from urllib.parse import urlsplit

from fastapi.responses import JSONResponse, Response
from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from shared.openai_compat import BODY_TIMEOUT_S, MAX_BODY_BYTES, ApiError

LOOPBACK = ("localhost", "127.0.0.1", "::1")
WILDCARD = ("0.0.0.0", "::")


@dataclass(frozen=True)
class HttpConfig:
    """An endpoint's HTTP settings: whom it answers (when Guard stands in front of it) and the
    bodies it reads.

    host:           the interface it listens on; a request's Host must be it or a loopback name
                    (listening on every interface, any address literal too)
    allow_origins:  browser origins, besides the endpoint's own, whose pages may call it (CORS)
    max_body_bytes: a POST body over this is refused (413) and read no further
    body_timeout_s: the whole body must arrive within this (408)
    """

    ORIGIN_OPTION: ClassVar[str] = "--allow-origin"  # where an operator allows another origin

    host: str = "127.0.0.1"
    allow_origins: tuple[str, ...] = ()
    max_body_bytes: int = MAX_BODY_BYTES
    body_timeout_s: float = BODY_TIMEOUT_S

    def __post_init__(self) -> None:
        for o in self.allow_origins:
            if origin_key(o) is None:
                raise ValueError(
                    f"allowed origin {o!r}: give an origin such as http://localhost:3000 "
                    "(http or https, a host, an optional port, no path)"
                )
        if self.max_body_bytes < 1 or not self.body_timeout_s > 0:
            raise ValueError("max_body_bytes must be >= 1 and body_timeout_s > 0")

    def host_allowed(self, name: str) -> bool:
        """Whether a request naming `name` in Host (or Origin) addresses this endpoint."""
        bound = self.host.strip("[]").lower()
        if name in LOOPBACK or name == bound:
            return True
        if bound in WILDCARD:  # an address literal cannot be rebound (a rebinding page names a domain)
            with contextlib.suppress(ValueError):
                ipaddress.ip_address(name)
                return True
        return False


def origin_key(origin: str) -> tuple[str, str, int] | None:
    """(scheme, host, port) of an origin such as `http://localhost:8080`; None if it is not one."""
    try:
        u = urlsplit(origin.strip())
        port = u.port
    except ValueError:
        return None
    if u.scheme not in ("http", "https") or not u.hostname or u.username or u.password:
        return None
    if u.path not in ("", "/") or u.query or u.fragment:
        return None
    return u.scheme, u.hostname.lower(), port or (443 if u.scheme == "https" else 80)


class Guard:
    """Refuses, before routing or reading a byte of the body, what a web page could send on the
    user's behalf (another Host, another Origin, a body that is not JSON) and bodies declared over
    the limit; adds CORS headers for the allowed origins (HttpConfig)."""

    def __init__(self, app: ASGIApp, config: HttpConfig) -> None:
        self.app = app
        self.config = config
        self.allowed = {k for o in config.allow_origins if (k := origin_key(o)) is not None}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        try:
            cors = self.check(scope, headers)
        except ApiError as exc:
            # the body is not read: the connection closes after the answer
            response = JSONResponse(
                exc.body(), exc.status, headers={**(exc.headers or {}), "Connection": "close"}
            )
            await response(scope, receive, send)
            return
        if cors is None:
            await self.app(scope, receive, send)
            return
        if scope["method"] == "OPTIONS" and "access-control-request-method" in headers:
            await Response(status_code=204, headers=self._cors(cors, preflight=headers))(scope, receive, send)
            return

        async def send_cors(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message).update(self._cors(cors))
            await send(message)

        await self.app(scope, receive, send_cors)

    def check(self, scope: Scope, headers: Headers) -> str | None:
        """Raise ApiError for a refused request; the allowed foreign Origin (to answer with CORS
        headers) or None."""
        scheme = scope.get("scheme", "http")
        host_header = headers.get("host", "")
        host = origin_key(f"{scheme}://{host_header}") if host_header else None
        if host is None or not self.config.host_allowed(host[1]):
            names = ", ".join(sorted({*LOOPBACK, self.config.host}))
            raise ApiError(
                421,
                f"the Host header {host_header!r} does not name this endpoint (it answers to {names}): "
                "a page of another site cannot use it",
                "Host",
                "misdirected_request",
            )
        foreign: str | None = None
        origin = headers.get("origin")
        if origin is not None:
            o = origin_key(origin)
            own = o is not None and o[0] == scheme and o[2] == host[2] and self.config.host_allowed(o[1])
            if not own and o not in self.allowed:
                raise ApiError(
                    403,
                    f"the origin {origin!r} may not call this endpoint: only its own pages may, and the "
                    f"origins given with `{self.config.ORIGIN_OPTION}`",
                    "Origin",
                    "origin_not_allowed",
                )
            foreign = None if own else origin
        if scope["method"] == "POST":
            ctype = headers.get("content-type")
            if ctype is None or ctype.split(";")[0].strip().lower() != "application/json":
                raise ApiError(
                    415,
                    f"the body must be JSON sent with Content-Type: application/json (got {ctype!r})",
                    "Content-Type",
                    "unsupported_media_type",
                )
            length = headers.get("content-length")
            if length is not None:
                if not length.strip().isdigit():
                    raise ApiError(400, f"Content-Length {length!r} is not a byte count", "Content-Length")
                if len(length.strip()) > 18 or int(length) > self.config.max_body_bytes:
                    raise too_large(self.config)
        return foreign

    @staticmethod
    def _cors(origin: str, preflight: Headers | None = None) -> dict[str, str]:
        h = {"Access-Control-Allow-Origin": origin, "Vary": "Origin"}
        if preflight is not None:
            h["Access-Control-Allow-Methods"] = "GET, POST, OPTIONS"
            asked = preflight.get("access-control-request-headers")
            h["Access-Control-Allow-Headers"] = asked or "Content-Type, Authorization"
            h["Access-Control-Max-Age"] = "600"
        return h


def too_large(config: HttpConfig) -> ApiError:
    return ApiError(413, f"the request body is over the limit of {config.max_body_bytes} bytes", None,
                    "too_large", headers={"Connection": "close"})  # fmt: skip
