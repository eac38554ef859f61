"""`edge-client serve`: an OpenAI-compatible endpoint on the device, backed by the cloud verifier.

Apps that speak the OpenAI API point at `http://127.0.0.1:8080/v1`; each request drafts here (the
local draft model) and is verified in the cloud, so the answer is exactly the cloud target's.
`temperature` 0 is `greedy`, above it `match` (seeded: reproducible); an extra `mode` field asks
for `mss` / `rrs` where the key allows them. Responses carry `usage` and, in an extra `treespec`
field, the speculation's figures (tokens per round, rounds, pre-speculation hit rate, verify and
round-trip times). One generation runs at a time (the draft model is single-threaded); others wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse

from edge_client.client import EdgeClient, GenerationError
from shared.messages import Mode, Verdict
from shared.openai_compat import (
    MAX_BODY_BYTES,
    SSE_DONE,
    ApiError,
    CompletionRequest,
    chat_messages,
    choice,
    chunk_choice,
    completion_prompt_value,
    new_id,
    parse_common,
    parse_json_body,
    sse,
    usage,
)


def _respond(exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


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


def create_app(make_client: Callable[[], EdgeClient]) -> FastAPI:
    """The local API over one verifier session (opened on the first request, reopened if it drops)."""
    app = FastAPI(title="edge-client serve")
    lock = asyncio.Lock()
    box: dict[str, EdgeClient] = {}

    async def session() -> EdgeClient:
        c = box.get("client")
        if c is None or c.welcome is None:
            c = make_client()
            try:
                await c.connect()
            except GenerationError as exc:
                raise ApiError(
                    502, f"the verifier is unreachable: {exc}", None, "verifier_unreachable", "server_error"
                ) from None
            box["client"] = c
        return c

    @app.get("/v1/models")
    async def models() -> Response:
        try:
            async with lock:
                c = await session()
        except ApiError as exc:
            return _respond(exc)
        assert c.welcome is not None
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {
                        "id": c.welcome.model_id,
                        "object": "model",
                        "created": 0,
                        "owned_by": "treespec (verified in the cloud)",
                    }
                ],
            }
        )

    async def handle(request: Request, chat: bool) -> Response:
        raw = await request.body()
        try:
            if len(raw) > MAX_BODY_BYTES:
                raise ApiError(413, f"the request body is over {MAX_BODY_BYTES} bytes", None, "too_large")
            body = parse_json_body(raw)
        except ApiError as exc:
            return _respond(exc)
        await lock.acquire()  # released when the generation (or its stream) ends
        try:
            c = await session()
            assert c.welcome is not None
            model = c.welcome.model_id
            if body.get("model") not in (None, model):
                raise ApiError(
                    404,
                    f"the model {body['model']!r} is not served here (this is {model!r})",
                    "model",
                    "model_not_found",
                )
            if chat:
                ids = c.encode_prompt(chat_messages(body))
            else:
                p = completion_prompt_value(body, c.welcome.vocab_size)
                ids = c.encode_prompt(p, raw=True) if isinstance(p, str) else p
            req = parse_common(body, ids, c.welcome.limits.max_context, chat)
            mode = _mode(body, req, c)
        except ApiError as exc:
            lock.release()
            return _respond(exc)
        except Exception:
            lock.release()
            raise
        rid, created = new_id(chat), int(time.time())
        stream = _generate(c, req, mode)
        if req.stream:
            return StreamingResponse(
                _sse(stream, lock, c, req, model, rid, created, chat), media_type="text/event-stream"
            )
        try:
            parts = []
            finish = "stop"
            async for piece, fin in stream:
                parts.append(piece)
                finish = fin or finish
        except GenerationError as exc:
            box.pop("client", None)  # reopen the session next time
            return _respond(ApiError(502, str(exc), None, "verifier_error", "server_error"))
        finally:
            lock.release()
        gen = c.last
        assert gen is not None
        obj = "chat.completion" if chat else "text_completion"
        return JSONResponse(
            {
                "id": rid,
                "object": obj,
                "created": created,
                "model": model,
                "choices": [choice(chat, "".join(parts), finish)],
                "usage": usage(len(ids), len(gen.tokens)),
                "treespec": speculation_stats(c),
            }
        )

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await handle(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await handle(request, chat=False)

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "alive"}

    @app.get("/")
    async def page() -> Response:
        return HTMLResponse(LIVE_PAGE.read_text(encoding="utf-8"))

    @app.post("/live")
    async def live(request: Request) -> Response:
        """The page's stream: per verdict, its tokens with how each came, and the running figures."""
        try:
            body = parse_json_body(await request.body())
            prompt = body.get("prompt")
            if not isinstance(prompt, str) or not prompt.strip():
                raise ApiError(400, "'prompt' must be a non-empty string", "prompt")
            n = body.get("max_tokens", 96)
            if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= 4096:
                raise ApiError(400, "'max_tokens' must be an integer in [1, 4096]", "max_tokens")
        except ApiError as exc:
            return _respond(exc)
        await lock.acquire()
        try:
            c = await session()
        except ApiError as exc:
            lock.release()
            return _respond(exc)
        mode = Mode.AR if body.get("cloud_only") else Mode.GREEDY
        return StreamingResponse(_live(c, prompt, n, mode, lock), media_type="text/event-stream")

    return app


LIVE_PAGE = Path(__file__).resolve().parent / "static" / "live.html"


async def _live(c: EdgeClient, prompt: str, n: int, mode: Mode, lock: asyncio.Lock) -> AsyncIterator[bytes]:
    events: asyncio.Queue[bytes | None] = asyncio.Queue()

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
        try:
            async for _ in c.generate(prompt, max_new_tokens=n, mode=mode, on_verdict=on_verdict):
                pass
            events.put_nowait(
                f"data: {json.dumps({'done': True, 'stats': speculation_stats(c)})}\n\n".encode()
            )
        except GenerationError as exc:
            events.put_nowait(f"data: {json.dumps({'error': str(exc)})}\n\n".encode())
        finally:
            events.put_nowait(None)

    task = asyncio.create_task(produce())
    try:
        while (item := await events.get()) is not None:
            yield item
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
        lock.release()


def _mode(body: dict[str, Any], req: CompletionRequest, c: EdgeClient) -> Mode:
    """temperature 0: greedy, else match; an extra `mode` field asks for another (if the key may)."""
    asked = body.get("mode")
    if asked is None:
        return Mode.GREEDY if req.temperature == 0 else Mode.MATCH
    try:
        mode = Mode(asked)
    except ValueError:
        raise ApiError(400, f"'mode' must be one of {[m.value for m in Mode]}", "mode") from None
    assert c.welcome is not None
    if mode not in c.welcome.allowed_modes:
        raise ApiError(
            403, f"the verifier does not allow mode {mode.value} for this key", "mode", "mode_not_allowed"
        )
    if mode.stochastic and req.temperature <= 0:
        raise ApiError(400, f"mode {mode.value} samples: give a temperature > 0", "temperature")
    return mode


async def _generate(
    c: EdgeClient, req: CompletionRequest, mode: Mode
) -> AsyncIterator[tuple[str, str | None]]:
    """(text piece, finish reason on the last one)."""
    async for piece in c.generate(
        req.prompt_ids,
        max_new_tokens=req.max_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        seed=req.seed,
        mode=mode,
        stop=req.stop,
    ):
        yield piece, None
    gen = c.last
    reason = gen.reason if gen is not None else None
    yield "", "length" if reason in ("length", "context") else "stop"


async def _sse(
    stream: AsyncIterator[tuple[str, str | None]],
    lock: asyncio.Lock,
    c: EdgeClient,
    req: CompletionRequest,
    model: str,
    rid: str,
    created: int,
    chat: bool,
) -> AsyncIterator[bytes]:
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
        yield f"data: {json.dumps({'error': {'message': str(exc), 'type': 'server_error'}})}\n\n".encode()
    finally:
        lock.release()
