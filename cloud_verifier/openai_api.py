"""OpenAI-compatible HTTP API on the verifier: /v1/completions, /v1/chat/completions, /v1/models.

Each request is one target-only generation (mode `ar`) in the same engine as the speculative
sessions, so it is batched with them step by step. Sampling is the verifier's: temperature 0 is
greedy, and a seeded request samples with the keyed sampler, so it emits exactly the tokens of a
seeded `ar` session (and of a seeded `match` one). Errors have OpenAI's body:
`{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from cloud_verifier.admission import Admission, Refused, Ticket
from cloud_verifier.auth import AuthError, KeyStore, Principal
from cloud_verifier.engine import Engine
from cloud_verifier.engine_state import RoundResult
from cloud_verifier.model import Target
from shared.messages import Mode, Prompt
from shared.openai_compat import (
    BODY_TIMEOUT_S,
    MAX_BODY_BYTES,
    SSE_DONE,
    ApiError,
    CompletionRequest,
    chat_messages,
    chunk_choice,
    completion_prompt_value,
    new_id,
    parse_common,
    parse_json_body,
    sse,
    usage,
)
from shared.openai_compat import choice as whole_choice


def completion_prompt(body: dict[str, Any], target: Target) -> list[int]:
    p = completion_prompt_value(body, target.config.vocab_size)
    return target.tokenizer.encode(p) if isinstance(p, str) else p


def chat_prompt(body: dict[str, Any], target: Target) -> list[int]:
    try:
        text = target.tokenizer.apply_chat_template(chat_messages(body), add_generation_prompt=True)
    except ApiError:
        raise
    except Exception as exc:
        raise ApiError(400, f"the chat template failed on these messages: {exc}", "messages") from None
    return target.tokenizer.encode(text, add_special=False)


# ------------------------------------------------------------------------------------- decoding
class TextStream:
    """Token ids in, text out as it becomes final: incremental detokenization (a token that ends
    mid-character waits for the next), and stop strings cut the text (held back while a stop string
    might still begin in it)."""

    def __init__(self, target: Target, stops: Sequence[str]) -> None:
        self.tok = target.tokenizer
        self.special = set(target.eos_ids)
        self.stops = tuple(stops)
        self.ids: list[int] = []
        self.text = ""  # decoded so far (final characters only)
        self.emitted = 0  # characters of text already given out
        self.stopped = False

    def add(self, ids: Sequence[int]) -> str:
        """Append tokens; returns the newly final text (may be empty)."""
        self.ids.extend(int(t) for t in ids if int(t) not in self.special)
        full = self.tok.decode(self.ids, skip_special=True)
        if full.endswith("\ufffd"):
            return ""
        self.text = full
        return self._release(final=False)

    def finish(self) -> str:
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if self.stopped:
            return ""
        end = len(self.text)
        for s in self.stops:
            at = self.text.find(s, max(0, self.emitted - len(s) + 1))
            if at != -1 and at < end:
                end = at
                self.stopped = True
        if not self.stopped and not final:
            for s in self.stops:  # keep back a tail that may be the start of a stop string
                for k in range(min(len(s) - 1, end - self.emitted), 0, -1):
                    if self.text[end - k : end] == s[:k]:
                        end -= k
                        break
        out = self.text[self.emitted : end]
        self.emitted = max(self.emitted, end)
        return out


@dataclass
class Generation:
    """One request's target-only generation in the engine."""

    engine: Engine
    req: CompletionRequest
    admission: Admission
    who: Principal
    ticket: Ticket
    results: asyncio.Queue[RoundResult] = field(default_factory=asyncio.Queue)
    ended: bool = False

    def start(self) -> None:
        r = self.req
        prompt = Prompt(
            tokens=np.asarray(r.prompt_ids, dtype=np.int32),
            mode=Mode.AR,
            temperature=r.temperature,
            top_k=r.top_k,
            top_p=r.top_p,
            seed=r.seed,
            max_new_tokens=r.max_tokens,
        )
        self.seq = self.engine.open(self._on_result)
        self.engine.start(self.seq, prompt, prompt.tokens)

    def _on_result(self, res: RoundResult) -> None:
        self.results.put_nowait(res)
        self.admission.spend(self.who, len(res.tokens))
        if not res.done and not self.ended:
            self.engine.submit(self.seq, 0, None)

    def close(self) -> None:
        if not self.ended:
            self.ended = True
            self.engine.close(self.seq)
            self.seq.on_result = _ignore
            self.admission.release(self.ticket)

    async def stream(self) -> AsyncIterator[RoundResult]:
        while True:
            res = await self.results.get()
            yield res
            if res.done or res.error is not None:
                return


def _ignore(result: RoundResult) -> None:
    return None


# ------------------------------------------------------------------------------------- the routes
@dataclass
class ApiContext:
    """What the routes need from the service (filled in once the target is loaded)."""

    keys: KeyStore
    max_context: int
    admission: Admission  # slots shared with the WebSocket sessions, per-key limits
    engine: Callable[[], Engine | None]
    target: Callable[[], Target | None]
    model_id: Callable[[], str | None]
    on_done: Callable[[float, int, float], None] | None = None  # (time to first token, tokens, seconds)
    running: int = 0


def install(app: FastAPI, ctx: ApiContext) -> None:
    """Add the OpenAI-compatible routes to `app`."""

    def authorize(request: Request) -> Principal:
        auth = request.headers.get("authorization", "")
        key = auth[7:].strip() if auth.lower().startswith("bearer ") else None
        try:
            return ctx.keys.authenticate(key)
        except AuthError as exc:
            raise ApiError(401, str(exc), None, "invalid_api_key") from None

    def ready() -> tuple[Engine, Target, str]:
        engine, target, model = ctx.engine(), ctx.target(), ctx.model_id()
        if engine is None or target is None or model is None:
            raise ApiError(
                503, "the verifier is not ready", None, "not_ready", "server_error", {"Retry-After": "5"}
            )
        return engine, target, model

    async def read_body(request: Request) -> dict[str, Any]:
        raw = b""
        try:
            async with asyncio.timeout(BODY_TIMEOUT_S):
                async for chunk in request.stream():
                    raw += chunk
                    if len(raw) > MAX_BODY_BYTES:
                        raise ApiError(
                            413, f"the request body is over {MAX_BODY_BYTES} bytes", None, "too_large"
                        )
        except TimeoutError:
            raise ApiError(408, f"the request body did not arrive within {BODY_TIMEOUT_S:g} s", None,
                           "timeout") from None  # fmt: skip
        return parse_json_body(raw)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        try:
            authorize(request)
            _, _, model = ready()
        except ApiError as exc:
            return _respond(exc)
        data = [{"id": model, "object": "model", "created": 0, "owned_by": "treespec"}]
        return JSONResponse({"object": "list", "data": data})

    async def handle(request: Request, chat: bool) -> Response:
        try:
            who = authorize(request)
            engine, target, model = ready()
            body = await read_body(request)
            asked = body.get("model")
            if asked is not None and asked != model:
                raise ApiError(404, f"the model {asked!r} is not served here (this is {model!r})", "model",
                               "model_not_found")  # fmt: skip
            ids = chat_prompt(body, target) if chat else completion_prompt(body, target)
            req = parse_common(body, ids, ctx.max_context, chat)
            try:
                ticket = await ctx.admission.acquire(who)
            except Refused as exc:
                raise ApiError(429, exc.reason, None, "rate_limit_exceeded", "rate_limit_error",
                               {"Retry-After": str(exc.retry_after_s)}) from None  # fmt: skip
        except ApiError as exc:
            return _respond(exc)
        gen = Generation(engine, req, ctx.admission, who, ticket)
        gen.start()
        ctx.running += 1
        rid = new_id(chat)
        created = int(time.time())
        if req.stream:
            return StreamingResponse(
                _sse(gen, target, model, rid, created, chat, ctx), media_type="text/event-stream"
            )
        try:
            text, ids_out, finish, err = await _collect(gen, target, ctx)
        finally:
            gen.close()
            ctx.running -= 1
        if err is not None:
            return _respond(ApiError(500, err, None, "internal_error", "server_error"))
        counts = _usage(req, ids_out)
        choice = whole_choice(chat, text, finish)
        if req.return_token_ids:
            choice["token_ids"] = ids_out
        obj = "chat.completion" if chat else "text_completion"
        return JSONResponse(
            {
                "id": rid,
                "object": obj,
                "created": created,
                "model": model,
                "choices": [choice],
                "usage": counts,
            }
        )

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await handle(request, chat=True)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> Response:
        return _respond(exc)


def _usage(req: CompletionRequest, ids_out: list[int]) -> dict[str, int]:
    return usage(len(req.prompt_ids), len(ids_out))


def _respond(exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


async def _tokens(
    gen: Generation, text: TextStream, ctx: ApiContext
) -> AsyncIterator[tuple[str, list[int], str | None, str | None]]:
    """(new text, new token ids, finish reason or None, error or None) per engine result."""
    t0 = time.perf_counter()
    first: float | None = None
    async for res in gen.stream():
        if res.error is not None:
            yield "", [], None, res.error.message
            return
        if first is None:
            first = time.perf_counter() - t0
        piece = text.add(res.tokens)
        finish = None
        if text.stopped:
            finish = "stop"
        elif res.done:
            finish = "length" if res.reason in ("length", "context") else "stop"
            piece += text.finish()
        yield piece, list(res.tokens), finish, None
        if finish is not None:
            break
    if ctx.on_done is not None and first is not None:
        ctx.on_done(first, len(text.ids), time.perf_counter() - t0)


async def _collect(
    gen: Generation, target: Target, ctx: ApiContext
) -> tuple[str, list[int], str, str | None]:
    text = TextStream(target, gen.req.stop)
    parts: list[str] = []
    ids: list[int] = []
    finish = "length"
    async for piece, new, fin, err in _tokens(gen, text, ctx):
        if err is not None:
            return "", ids, "error", err
        parts.append(piece)
        ids.extend(new)
        if fin is not None:
            finish = fin
    return "".join(parts), ids, finish, None


async def _sse(
    gen: Generation, target: Target, model: str, rid: str, created: int, chat: bool, ctx: ApiContext
) -> AsyncIterator[bytes]:
    """Server-sent events in OpenAI's chunk format, ending in `data: [DONE]`."""

    def event(choices: list[dict[str, Any]], **extra: Any) -> bytes:
        return sse(rid, created, model, chat, choices, **extra)

    def choice(piece: str, finish: str | None, new: list[int]) -> dict[str, Any]:
        c = chunk_choice(chat, piece, finish)
        if gen.req.return_token_ids:
            c["token_ids"] = new
        return c

    text = TextStream(target, gen.req.stop)
    ids: list[int] = []
    try:
        if chat:
            yield event([{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}])
        async for piece, new, fin, err in _tokens(gen, text, ctx):
            if err is not None:
                doc = {
                    "error": {"message": err, "type": "server_error", "param": None, "code": "internal_error"}
                }
                yield f"data: {json.dumps(doc)}\n\n".encode()
                break
            ids.extend(new)
            if piece or fin is not None or gen.req.return_token_ids:
                yield event([choice(piece, fin, new)])
        if gen.req.include_usage:
            yield event([], usage=_usage(gen.req, ids))
        yield SSE_DONE
    finally:  # also when the client goes away mid-stream: the engine drops the sequence
        gen.close()
        ctx.running -= 1
