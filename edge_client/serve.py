"""`edge-client serve`: an OpenAI-compatible endpoint on the device, backed by the cloud verifier.

Apps that speak the OpenAI API point at `http://127.0.0.1:8080/v1`; each request drafts here (the
local draft model) and is verified in the cloud, so the answer is exactly the cloud target's.
`temperature` 0 is `greedy`, above it `match` (seeded: reproducible); an extra `mode` field asks
for `mss` / `rrs` where the key allows them. Responses carry `usage` and, in an extra `treespec`
field, the speculation's figures (tokens per round, rounds, pre-speculation hit rate, verify and
round-trip times). One generation runs at a time (the draft model is single-threaded); a few others
wait for it, each for a bounded time (ServeConfig).

The endpoint spends the user's key, so it answers only its own (edge_client.http_guard: Host,
Origin, Content-Type, body size). A generation whose client goes away (a stream closed mid-answer,
an abandoned request) is stopped, and any failure is an OpenAI-style JSON error.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from edge_client.client import EdgeClient, GenerationError
from edge_client.http_guard import Guard, ServeConfig, read_json, valid_text, watch_disconnect
from edge_client.web_edge import WebEdge
from shared.messages import Mode, Verdict
from shared.openai_compat import (
    SSE_DONE,
    ApiError,
    CompletionRequest,
    chat_messages,
    choice,
    chunk_choice,
    completion_prompt_value,
    new_id,
    parse_common,
    sse,
    usage,
)
from shared.protocol import ClientState

log = logging.getLogger(__name__)


def _respond(exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


def _internal(what: str) -> ApiError:
    return ApiError(500, f"{what} failed inside edge-client serve (see its log)", None, "internal_error",
                    "server_error")  # fmt: skip


def _gone() -> ApiError:
    return ApiError(499, "the client went away; the generation was cancelled", None, "client_closed")


class EdgeSession:
    """The one verifier session behind the endpoint and the gate of its generations: one at a
    time, at most `max_waiting` behind it for at most `wait_s` each; reading routes never wait."""

    def __init__(self, make_client: Callable[[], EdgeClient], config: ServeConfig) -> None:
        self.make_client = make_client
        self.config = config
        self.client: EdgeClient | None = None
        self.model_id: str | None = None  # the last welcome's
        self.waiting = 0
        self._connecting = asyncio.Lock()
        self._generating = asyncio.Lock()
        self._releases: set[asyncio.Task[None]] = set()

    async def session(self) -> EdgeClient:
        """The open session (opened on first use, reopened after a drop); for a generation, which
        holds the gate (a session without a welcome may be resuming a generation)."""
        async with self._connecting:
            c = self.client
            if c is not None and c.welcome is not None:
                return c
            if c is not None:
                await self._discard(c)
            c = self.make_client()
            try:
                await c.connect()
            except GenerationError as exc:
                await self._discard(c)
                raise ApiError(
                    502, f"the verifier is unreachable: {exc}", None, "verifier_unreachable", "server_error"
                ) from None
            self.client = c
            assert c.welcome is not None
            self.model_id = c.welcome.model_id
            return c

    async def model(self) -> str:
        """The model served, without touching a session a generation may be using (or resuming)."""
        if self.model_id is None:
            await self.session()
        assert self.model_id is not None
        return self.model_id

    async def acquire(self, gone: asyncio.Task[None]) -> None:
        """Wait for the running generation to end (ApiError: too many waiting, waited too long, or
        the client went away meanwhile)."""
        cfg = self.config
        if self._generating.locked() and self.waiting >= cfg.max_waiting:
            raise ApiError(
                429,
                f"busy: a generation is running and {self.waiting} requests already wait for the draft "
                f"model (at most {cfg.max_waiting}); try again later",
                None,
                "too_many_waiting",
                "rate_limit_error",
                {"Retry-After": "5"},
            )
        self.waiting += 1
        take = asyncio.ensure_future(self._generating.acquire())
        try:
            await asyncio.wait({take, gone}, timeout=cfg.wait_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self.waiting -= 1
            if not take.done():
                take.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await take
        held = take.done() and not take.cancelled() and take.exception() is None
        if held and not gone.done():
            return
        if held:
            self._generating.release()
        if gone.done():
            raise _gone()
        raise ApiError(
            503,
            f"busy: another generation has held the draft model for the longest wait, {cfg.wait_s:g} s; "
            "try again later",
            None,
            "busy",
            "server_error",
            {"Retry-After": "5"},
        )

    def release(
        self,
        c: EdgeClient | None,
        failed: bool = False,
        stop: Callable[[], Awaitable[bool]] | None = None,
    ) -> asyncio.Task[None]:
        """End a generation, in a task of its own (a cancelled request cannot interrupt it): `stop`
        what is still running (returns whether it failed); a session left mid-generation (its client
        went away, the verifier misbehaved) or after a failure is closed, so the verifier stops and
        the next request opens a new one; then the next waiting request goes."""

        async def run() -> None:
            try:
                bad = failed
                if stop is not None:
                    bad = await stop() or bad
                if c is not None and (bad or c is not self.client or _mid_generation(c)):
                    await self._discard(c)
            except Exception:
                log.exception("edge-client serve: ending a generation")
            finally:
                self._generating.release()

        task = asyncio.create_task(run())
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)
        return task

    async def _discard(self, c: EdgeClient) -> None:
        if self.client is c:
            self.client = None
        try:
            await c.close()
        except Exception:
            log.exception("edge-client serve: closing a verifier session")


def _mid_generation(c: EdgeClient) -> bool:
    """Left generating with no cancel sent (a cancelling session reads its end on the next generate)."""
    return c.welcome is not None and c.proto.state is ClientState.GENERATING


def speculation_stats(client: EdgeClient) -> dict[str, Any]:
    """The last generation's figures, for the `treespec` field of a response."""
    gen = client.last
    if gen is None:
        return {}
    d = gen.stats.as_dict()
    keys = (
        "rounds",
        "tau",
        "hit_rate",
        "verify_ms",
        "rtt_ms",
        "draft_ms",
        "ms_per_token",
        "bytes_up",
        "bytes_down",
    )
    return {"tokens": len(gen.tokens), **{k: d[k] for k in keys if k in d}}


class _Stream(StreamingResponse):
    """A streaming response that closes its generator as soon as it ends, however it ends (the
    client gone mid-answer included), not whenever the garbage collector gets to it."""

    def __init__(self, body: AsyncGenerator[bytes, None]) -> None:
        super().__init__(body, media_type="text/event-stream")
        self._body = body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._body.aclose()


def create_app(
    make_client: Callable[[], EdgeClient], config: ServeConfig | None = None, web: WebEdge | None = None
) -> FastAPI:
    """The local API over one verifier session (opened on the first request, reopened if it drops);
    with `web`, the browser edge's page and files at /edge/ (edge_client.web_edge)."""
    cfg = config or ServeConfig()
    app = FastAPI(title="edge-client serve")
    app.add_middleware(Guard, config=cfg)
    edge = EdgeSession(make_client, cfg)
    app.state.edge = edge
    app.add_exception_handler(Exception, _unexpected)
    routes = _Routes(edge, cfg)
    app.get("/v1/models")(routes.models)
    app.post("/v1/chat/completions")(routes.chat_completions)
    app.post("/v1/completions")(routes.completions)
    app.get("/healthz")(routes.healthz)
    app.get("/")(routes.page)
    app.post("/live")(routes.live)
    if web is not None:
        web.mount(app)
    return app


async def _unexpected(request: Request, exc: Exception) -> Response:
    return _respond(_internal("the request"))


class _Routes:
    """The endpoint's route handlers, over the one EdgeSession of an app (create_app wires them)."""

    def __init__(self, edge: EdgeSession, cfg: ServeConfig) -> None:
        self.edge = edge
        self.cfg = cfg

    async def models(self) -> Response:
        try:
            model = await self.edge.model()
        except ApiError as exc:
            return _respond(exc)
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {
                        "id": model,
                        "object": "model",
                        "created": 0,
                        "owned_by": "treespec (verified in the cloud)",
                    }
                ],
            }
        )

    async def chat_completions(self, request: Request) -> Response:
        return await self.handle(request, chat=True)

    async def completions(self, request: Request) -> Response:
        return await self.handle(request, chat=False)

    async def healthz(self) -> dict[str, str]:
        return {"status": "alive"}

    async def page(self) -> Response:
        return HTMLResponse(LIVE_PAGE.read_text(encoding="utf-8"))

    async def handle(self, request: Request, chat: bool) -> Response:
        """A completion request: its body read and checked, then answered while the client stays."""
        try:
            body = await read_json(request, self.cfg)
        except ApiError as exc:
            return _respond(exc)
        gone = watch_disconnect(request)
        try:
            return await self.complete(body, chat, gone)
        finally:
            gone.cancel()

    async def complete(self, body: dict[str, Any], chat: bool, gone: asyncio.Task[None]) -> Response:
        """Wait for the draft model, then stream the completion (SSE) or answer it whole."""
        edge = self.edge
        try:
            await edge.acquire(gone)
        except ApiError as exc:
            return _respond(exc)
        c: EdgeClient | None = None
        try:
            c = await edge.session()
            req, mode, model = _parse(body, chat, c, edge.config.mode)
            if gone.done():
                raise _gone()
        except ApiError as exc:
            edge.release(c)
            return _respond(exc)
        except Exception:
            log.exception("edge-client serve: reading a request")
            edge.release(c, failed=True)
            return _respond(_internal("reading the request"))
        rid, created = new_id(chat), int(time.time())
        stream = _generate(c, req, mode, edge.config.objective)
        if req.stream:
            return _Stream(_sse(stream, edge, c, req, model, rid, created, chat))
        run = asyncio.create_task(_collect(stream))
        failed = False
        try:
            await asyncio.wait({run, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not run.done():  # the client went away: stop drafting and verifying for no one
                run.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await run
                return _respond(_gone())
            err = run.exception()
            if isinstance(err, GenerationError):
                return _respond(ApiError(502, str(err), err.field, "verifier_error", "server_error"))
            if err is not None:
                failed = True
                log.error("edge-client serve: a generation failed", exc_info=err)
                return _respond(_internal("the generation"))
        finally:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(edge.release(c, failed))
        text, finish = run.result()
        return _completion(c, req, model, rid, created, chat, text, finish)

    async def live(self, request: Request) -> Response:
        """The page's stream: per verdict, its tokens with how each came, and the running figures."""
        try:
            body = await read_json(request, self.cfg)
            prompt, n = _live_request(body)
        except ApiError as exc:
            return _respond(exc)
        edge = self.edge
        gone = watch_disconnect(request)
        try:
            await edge.acquire(gone)
        except ApiError as exc:
            gone.cancel()
            return _respond(exc)
        c: EdgeClient | None = None
        try:
            c = await edge.session()
            if gone.done():
                raise _gone()
        except ApiError as exc:
            edge.release(c)
            return _respond(exc)
        finally:
            gone.cancel()
        mode = Mode.AR if body.get("cloud_only") else Mode.GREEDY
        return _Stream(_live(c, prompt, n, mode, edge))


def _completion(
    c: EdgeClient,
    req: CompletionRequest,
    model: str,
    rid: str,
    created: int,
    chat: bool,
    text: str,
    finish: str,
) -> JSONResponse:
    """The whole answer of a completion that was not streamed."""
    gen = c.last
    assert gen is not None
    obj = "chat.completion" if chat else "text_completion"
    return JSONResponse(
        {
            "id": rid,
            "object": obj,
            "created": created,
            "model": model,
            "choices": [choice(chat, text, finish)],
            "usage": usage(len(req.prompt_ids), len(gen.tokens)),
            "treespec": speculation_stats(c),
        }
    )


def _live_request(body: dict[str, Any]) -> tuple[str, int]:
    """The live page's prompt and max_tokens (default 96), checked (ApiError)."""
    prompt = body.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise ApiError(400, "'prompt' must be a non-empty string", "prompt")
    valid_text(prompt, "prompt")
    n = body.get("max_tokens", 96)
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= 4096:
        raise ApiError(400, "'max_tokens' must be an integer in [1, 4096]", "max_tokens")
    return prompt, n


LIVE_PAGE = Path(__file__).resolve().parent / "static" / "live.html"


def _parse(
    body: dict[str, Any], chat: bool, c: EdgeClient, default: str = "auto"
) -> tuple[CompletionRequest, Mode | str, str]:
    """The request, its mode and the model it names, checked against the session (ApiError)."""
    assert c.welcome is not None
    model = c.welcome.model_id
    if body.get("model") not in (None, model):
        raise ApiError(404, f"the model {body['model']!r} is not served here (this is {model!r})", "model",
                       "model_not_found")  # fmt: skip
    if chat:
        msgs = chat_messages(body)
        for m in msgs:
            valid_text(m["content"], "messages")
        ids = c.encode_prompt(msgs)
    else:
        p = completion_prompt_value(body, c.welcome.vocab_size)
        if isinstance(p, str):
            valid_text(p, "prompt")
            ids = c.encode_prompt(p, raw=True) if p else []
        else:
            ids = p
        if not ids:  # an empty prompt would become an empty chat turn (EdgeClient.generate)
            raise ApiError(400, "'prompt' is empty: give some text or at least one token id", "prompt")
    req = parse_common(body, ids, c.welcome.limits.max_context, chat)
    return req, _mode(body, req, c, default), model


def _sse_error(message: str, kind: str, code: str | None = None) -> bytes:
    doc = {"error": {"message": message, "type": kind, "param": None, "code": code}}
    return f"data: {json.dumps(doc, ensure_ascii=False)}\n\n".encode()


async def _live(
    c: EdgeClient, prompt: str, n: int, mode: Mode, edge: EdgeSession
) -> AsyncGenerator[bytes, None]:
    events: asyncio.Queue[bytes | None] = asyncio.Queue()
    failed = False

    def on_verdict(v: Verdict, prespeculated: bool) -> None:
        toks = v.tokens.tolist()
        accepted = len(v.accepted_nodes)
        out: list[dict[str, Any]] = []
        for i, t in enumerate(toks):
            text = c.tokenizer.token_bytes(t).decode("utf-8", errors="replace")
            if mode is Mode.AR:
                out.append({"text": text, "how": "target"})
            elif i < accepted:
                out.append({"text": text, "how": "accepted", "depth": i + 1})
            else:
                out.append({"text": text, "how": "bonus"})
        st = speculation_stats(c)
        doc = {"round": v.round, "tokens": out, "prespeculated": prespeculated, "done": v.done, "stats": st}
        events.put_nowait(f"data: {json.dumps(doc, ensure_ascii=False)}\n\n".encode())

    async def produce() -> None:
        nonlocal failed
        try:
            gen = c.generate(prompt, max_new_tokens=n, mode=mode, on_verdict=on_verdict)
            async with contextlib.aclosing(gen):
                async for _ in gen:
                    pass
            events.put_nowait(
                f"data: {json.dumps({'done': True, 'stats': speculation_stats(c)})}\n\n".encode()
            )
        except GenerationError as exc:
            events.put_nowait(f"data: {json.dumps({'error': str(exc)})}\n\n".encode())
        except Exception:
            failed = True
            log.exception("edge-client serve: a live generation failed")
            msg = "the generation failed inside edge-client serve (see its log)"
            events.put_nowait(f"data: {json.dumps({'error': msg})}\n\n".encode())
        finally:
            events.put_nowait(None)

    task = asyncio.create_task(produce())

    async def stop() -> bool:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        return failed

    try:
        while (item := await events.get()) is not None:
            yield item
    finally:
        edge.release(c, stop=stop)


def _mode(body: dict[str, Any], req: CompletionRequest, c: EdgeClient, default: str = "auto") -> Mode | str:
    """The served mode (`default`: auto, the SDK's planner, verified greedy at temperature 0 and
    match above; greedy or match: by the temperature); an extra `mode` field asks for another (if
    the key may)."""
    asked = body.get("mode", default)
    if asked == "auto":
        return "auto"
    if asked in ("greedy", "match") and "mode" not in body:
        return Mode.GREEDY if req.temperature == 0 else Mode.MATCH
    try:
        mode = Mode(asked)
    except (ValueError, TypeError):
        raise ApiError(400, f"'mode' must be one of {['auto', *(m.value for m in Mode)]}", "mode") from None
    assert c.welcome is not None
    if mode not in c.welcome.allowed_modes:
        raise ApiError(
            403, f"the verifier does not allow mode {mode.value} for this key", "mode", "mode_not_allowed"
        )
    if mode.stochastic and req.temperature <= 0:
        raise ApiError(400, f"mode {mode.value} samples: give a temperature > 0", "temperature")
    return mode


async def _generate(
    c: EdgeClient, req: CompletionRequest, mode: Mode | str, objective: str = "latency"
) -> AsyncGenerator[tuple[str, str | None], None]:
    """(text piece, finish reason on the last one)."""
    gen = c.generate(
        req.prompt_ids,
        max_new_tokens=req.max_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        seed=req.seed,
        mode=mode,
        objective=objective,
        stop=req.stop,
    )
    async with contextlib.aclosing(gen):  # closed here, not later by the garbage collector
        async for piece in gen:
            yield piece, None
    last = c.last
    reason = last.reason if last is not None else None
    yield "", "length" if reason in ("length", "context") else "stop"


async def _collect(stream: AsyncGenerator[tuple[str, str | None], None]) -> tuple[str, str]:
    parts: list[str] = []
    finish = "stop"
    async with contextlib.aclosing(stream):
        async for piece, fin in stream:
            parts.append(piece)
            finish = fin or finish
    return "".join(parts), finish


async def _sse(
    stream: AsyncGenerator[tuple[str, str | None], None],
    edge: EdgeSession,
    c: EdgeClient,
    req: CompletionRequest,
    model: str,
    rid: str,
    created: int,
    chat: bool,
) -> AsyncGenerator[bytes, None]:
    failed = False

    async def stop() -> bool:
        await stream.aclose()  # if the client left at a yield: the generation stops here
        return failed

    try:
        if chat:
            yield sse(
                rid,
                created,
                model,
                chat,
                [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}],
            )
        async for piece, fin in stream:
            if piece or fin is not None:
                extra = {"treespec": speculation_stats(c)} if fin is not None else {}
                yield sse(rid, created, model, chat, [chunk_choice(chat, piece, fin)], **extra)
        if req.include_usage and c.last is not None:
            yield sse(rid, created, model, chat, [], usage=usage(len(req.prompt_ids), len(c.last.tokens)))
        yield SSE_DONE
    except GenerationError as exc:
        yield _sse_error(str(exc), "server_error", "verifier_error")
    except Exception:
        failed = True
        log.exception("edge-client serve: a streamed generation failed")
        yield _sse_error("the generation failed inside edge-client serve (see its log)", "server_error",
                         "internal_error")  # fmt: skip
    finally:
        edge.release(c, stop=stop)


__all__ = ["EdgeSession", "ServeConfig", "create_app", "speculation_stats"]
