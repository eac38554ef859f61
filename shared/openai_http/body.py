"""Reading a request and answering an error, the same way on every OpenAI endpoint: the JSON body
within its limits (HttpConfig), the client's departure, the model a body names, and OpenAI's error
body `{"error": {"message", "type", "param", "code"}}`."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.requests import ClientDisconnect

from shared.openai_compat import ApiError, parse_json_body
from shared.openai_http.guard import HttpConfig, too_large

T = TypeVar("T")

# the raw body -> the JSON object (an endpoint may parse a large body off the event loop)
BodyParser = Callable[[bytes], Awaitable[dict[str, Any]]]


def respond(exc: ApiError) -> JSONResponse:
    """An ApiError as OpenAI's JSON error response."""
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


def client_gone() -> ApiError:
    """The answer to a client that went away (nobody reads it; the log shows 499)."""
    return ApiError(499, "the client went away; the generation was cancelled", None, "client_closed")


def internal(name: str, what: str) -> ApiError:
    """A failure nobody planned for, inside the endpoint called `name` (its log has the rest)."""
    return ApiError(500, f"{what} failed inside {name} (see its log)", None, "internal_error", "server_error")


async def _parse_inline(raw: bytes) -> dict[str, Any]:
    return parse_json_body(raw)


async def read_json(request: Request, config: HttpConfig, parse: BodyParser | None = None) -> dict[str, Any]:
    """The body as a JSON object, read as it arrives and no further than the limit (413), within
    the body timeout (408; 499 for a client gone before it ended), then `parse`d (400)."""
    raw = bytearray()  # appended in place: many small chunks cost no more than one big one
    try:
        async with asyncio.timeout(config.body_timeout_s):
            async for chunk in request.stream():
                raw += chunk
                if len(raw) > config.max_body_bytes:
                    raise too_large(config)
    except TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {config.body_timeout_s:g} s", None,
                       "timeout", headers={"Connection": "close"}) from None  # fmt: skip
    except ClientDisconnect:  # gone before its body ended: no answer is read (not a server error)
        raise ApiError(499, "the client went away while sending the body", None, "client_closed") from None
    try:
        return await (parse or _parse_inline)(bytes(raw))
    except RecursionError:
        raise ApiError(400, "the body is not valid JSON: it nests too deeply", None, "invalid_json") from None


def valid_text(text: str, param: str) -> None:
    """A JSON string may hold a lone surrogate (\\ud800), which no tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ApiError(400, f"'{param}' is not valid Unicode: a lone surrogate at character {exc.start}",
                       param) from None  # fmt: skip


def check_model(body: dict[str, Any], model: str) -> None:
    """A body's optional "model" must name the model served (400 if not a string, 404 if another)."""
    asked = body.get("model")
    if asked is not None and not isinstance(asked, str):
        raise ApiError(400, "'model' must be a string", "model")
    if asked is not None and asked != model:
        raise ApiError(404, f"the model {asked[:100]!r} is not served here (this is {model!r})", "model",
                       "model_not_found")  # fmt: skip


def watch_disconnect(request: Request) -> asyncio.Task[None]:
    """A task that ends when the client goes away (start it once the body has been read)."""

    async def wait() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    return asyncio.create_task(wait())


async def until_gone(work: Awaitable[T], gone: asyncio.Task[None], late: Callable[[T], object]) -> T:
    """`work`'s result, unless the client goes away first: then the work is cancelled (a result
    that came all the same goes to `late`, to be undone) and the answer is a 499. A cancelled
    request cancels its work too."""
    task = asyncio.ensure_future(work)
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    if task.done():
        return task.result()
    task.cancel()
    await asyncio.wait({task})
    if not task.cancelled() and task.exception() is None:
        late(task.result())
    raise client_gone()
