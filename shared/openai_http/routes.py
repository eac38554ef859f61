"""The OpenAI routes over a generation source: /v1/models, /v1/completions and /v1/chat/completions,
answered whole or streamed as server-sent events in OpenAI's chunk format (a chat stream opens with
the assistant's role, and ends in `data: [DONE]`).

An endpoint supplies a CompletionSource: the model it serves and, per request, a Generation (its
pieces of text, and how it ends). This module reads the body, watches for the client's departure,
frames the answer and its errors, and ends the generation however the response ends: finished,
failed, its client gone (a whole answer's while it is collected, a stream's at once), or a stream
that never began."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from shared.openai_compat import (
    SSE_DONE,
    ApiError,
    CompletionRequest,
    chunk_choice,
    new_id,
    parse_json_body,
    sse,
    usage,
)
from shared.openai_compat import choice as whole_choice
from shared.openai_http.body import client_gone, internal, read_json, respond, watch_disconnect
from shared.openai_http.guard import Guard, HttpConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Piece:
    """A generation's next text (may be empty), its finish reason on the last, its token ids."""

    text: str
    finish: str | None = None
    token_ids: Sequence[int] = ()


@dataclass
class Generation:
    """One request's generation, as its endpoint hands it to the routes. `pieces` raises ApiError
    for a failure to report (any other exception is an internal error); `on_end(failed)` ends it
    (called once, however the response ends; what it returns, if anything, is awaited before a
    whole answer is sent)."""

    request: CompletionRequest
    model: str
    pieces: AsyncGenerator[Piece, None]
    on_end: Callable[[bool], Awaitable[None] | None]
    usage: Callable[[], dict[str, int] | None] | None = None  # default: the prompt + pieces' ids
    fields: Callable[[], dict[str, Any]] = dict  # extra top-level fields (whole, and last chunk)
    token_ids: bool = False  # each choice carries its token ids (vLLM's return_token_ids)
    _ended: bool = field(default=False, init=False)

    def end(self, failed: bool = False) -> Awaitable[None] | None:
        if self._ended:
            return None
        self._ended = True
        return self.on_end(failed)

    def counts(self, generated: int) -> dict[str, int] | None:
        if self.usage is not None:
            return self.usage()
        return usage(len(self.request.prompt_ids), generated)


class CompletionSource(ABC):
    """What an endpoint supplies to the OpenAI routes: the model it serves and its generations."""

    name = "the endpoint"  # in error messages and the log
    owned_by = "treespec"  # /v1/models
    config = HttpConfig()  # body limits (and, behind Guard, the hosts and origins answered)

    async def admit(self, request: Request) -> Any:
        """What must hold before a body is read (a key, a loaded model): ApiError refuses the
        request; what it returns is handed to `start`."""
        return None

    async def parse(self, raw: bytes) -> dict[str, Any]:
        """A body as a JSON object (ApiError 400)."""
        return parse_json_body(raw)

    @abstractmethod
    async def model(self, request: Request) -> str:
        """The model served (ApiError refuses)."""

    @abstractmethod
    async def start(
        self, admitted: Any, body: dict[str, Any], chat: bool, gone: asyncio.Task[None]
    ) -> Generation:
        """A checked request's generation, begun (ApiError refuses it; `gone` ends when the client
        goes away, which should stop the wait)."""


def install(app: FastAPI, source: CompletionSource, guard: bool = False) -> None:
    """Add the OpenAI routes over `source` to `app`, and OpenAI error bodies for any failure; with
    `guard`, Guard in front of every route (source.config's hosts, origins and bodies)."""
    if guard:
        app.add_middleware(Guard, config=source.config)
    routes = _OpenAIRoutes(source)
    app.get("/v1/models")(routes.models)
    app.post("/v1/completions")(routes.completions)
    app.post("/v1/chat/completions")(routes.chat_completions)

    async def api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        return respond(exc)

    async def unexpected(request: Request, exc: Exception) -> Response:
        return respond(internal(source.name, "the request"))

    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(Exception, unexpected)


class _OpenAIRoutes:
    def __init__(self, source: CompletionSource) -> None:
        self.source = source

    async def models(self, request: Request) -> Response:
        try:
            model = await self.source.model(request)
        except ApiError as exc:
            return respond(exc)
        data = [{"id": model, "object": "model", "created": 0, "owned_by": self.source.owned_by}]
        return JSONResponse({"object": "list", "data": data})

    async def completions(self, request: Request) -> Response:
        return await self.handle(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self.handle(request, chat=True)

    async def handle(self, request: Request, chat: bool) -> Response:
        """A completion: admitted, its body read, its generation begun, then answered while the
        client stays."""
        src = self.source
        try:
            admitted = await src.admit(request)
            body = await read_json(request, src.config, src.parse)
        except ApiError as exc:
            return respond(exc)
        gone = watch_disconnect(request)
        try:
            try:
                gen = await src.start(admitted, body, chat, gone)
            except ApiError as exc:
                return respond(exc)
            rid, created = new_id(chat), int(time.time())
            if gen.request.stream:
                return ClosingStream(_events(gen, rid, created, chat, src.name), gen.end)
            return await _whole(gen, rid, created, chat, gone, src.name)
        finally:
            gone.cancel()


class ClosingStream(StreamingResponse):
    """Server-sent events whose generator is closed as soon as the response ends, however it ends
    (the client gone mid-answer included), not whenever the garbage collector gets to it; then
    `on_close` (which also runs for a response that never began, whose generator's own `finally`
    never runs)."""

    def __init__(
        self, events: AsyncGenerator[bytes, None], on_close: Callable[[], object] | None = None
    ) -> None:
        super().__init__(events, media_type="text/event-stream")
        self.events = events
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await self.events.aclose()
            finally:
                if self.on_close is not None:
                    self.on_close()


def sse_error(exc: ApiError) -> bytes:
    """An error in a stream that has begun: OpenAI's error body as one event."""
    return sse_data(exc.body())


def sse_data(doc: dict[str, Any]) -> bytes:
    """One server-sent event holding a JSON document."""
    return f"data: {json.dumps(doc, ensure_ascii=False)}\n\n".encode()


async def _events(
    gen: Generation, rid: str, created: int, chat: bool, name: str
) -> AsyncGenerator[bytes, None]:
    """The generation as OpenAI's chunks; a failure is an error event, then `[DONE]`."""

    def event(choices: list[dict[str, Any]], **extra: Any) -> bytes:
        return sse(rid, created, gen.model, chat, choices, **extra)

    failed = False
    generated = 0
    try:
        if chat:
            yield event([{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}])
        async for p in gen.pieces:
            generated += len(p.token_ids)
            if p.text or p.finish is not None or gen.token_ids:
                c = chunk_choice(chat, p.text, p.finish)
                if gen.token_ids:
                    c["token_ids"] = list(p.token_ids)
                yield event([c], **(gen.fields() if p.finish is not None else {}))
        if gen.request.include_usage and (counts := gen.counts(generated)) is not None:
            yield event([], usage=counts)
        yield SSE_DONE
    except ApiError as exc:
        yield sse_error(exc) + SSE_DONE
    except Exception:
        failed = True
        log.exception("%s: a streamed generation failed", name)
        yield sse_error(internal(name, "the generation")) + SSE_DONE
    finally:  # the client gone at a yield included: the generation ends here
        gen.end(failed)


async def _gather(gen: Generation) -> tuple[str, str, list[int]]:
    parts: list[str] = []
    ids: list[int] = []
    finish = "stop"
    async with contextlib.aclosing(gen.pieces):  # closed here, not later by the garbage collector
        async for p in gen.pieces:
            parts.append(p.text)
            ids.extend(p.token_ids)
            finish = p.finish or finish
    return "".join(parts), finish, ids


async def _whole(
    gen: Generation, rid: str, created: int, chat: bool, gone: asyncio.Task[None], name: str
) -> Response:
    """The generation collected while the client stays (if it goes, the generation stops)."""
    run = asyncio.create_task(_gather(gen))
    try:
        await asyncio.wait({run, gone}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # this request is cancelled (a drain's deadline): so is its generation
        run.cancel()
        run.add_done_callback(lambda _: gen.end(True))
        raise
    failed = False
    try:
        if not run.done():  # the client went away: stop generating for no one
            run.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await run
            return respond(client_gone())
        err = run.exception()
        if isinstance(err, ApiError):
            return respond(err)
        if err is not None:
            failed = True
            log.error("%s: a generation failed", name, exc_info=err)
            return respond(internal(name, "the generation"))
    finally:
        ended = gen.end(failed)
        if ended is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(ended)
    text, finish, ids = run.result()
    choice = whole_choice(chat, text, finish)
    if gen.token_ids:
        choice["token_ids"] = ids
    obj = "chat.completion" if chat else "text_completion"
    doc = {"id": rid, "object": obj, "created": created, "model": gen.model, "choices": [choice]}
    return JSONResponse({**doc, "usage": gen.counts(len(ids)), **gen.fields()})
