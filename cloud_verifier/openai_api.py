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
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from cloud_verifier.admission import Admission, Refused, Ticket
from cloud_verifier.auth import AuthError, KeyStore, Principal
from cloud_verifier.engine import Engine, RoundResult
from cloud_verifier.model import Target
from shared.messages import Mode, Prompt

MAX_BODY_BYTES = 4 << 20  # a request body (prompt text or messages)
BODY_TIMEOUT_S = 30.0  # the whole body must arrive within this
MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 256
DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions
# parameters OpenAI defines that this server does not implement: refused unless at their no-op value
UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "logprobs": lambda v: v in (None, False, 0),
    "top_logprobs": lambda v: v in (None, 0),
    "best_of": lambda v: v in (None, 1),
    "echo": lambda v: v in (None, False),
    "suffix": lambda v: v in (None, ""),
    "presence_penalty": lambda v: v in (None, 0, 0.0),
    "frequency_penalty": lambda v: v in (None, 0, 0.0),
    "logit_bias": lambda v: not v,
    "tools": lambda v: not v,
    "functions": lambda v: not v,
    "response_format": lambda v: v in (None, {"type": "text"}),
}


class ApiError(Exception):
    """An OpenAI-style error: HTTP status, message, the parameter at fault, a code."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status, headers=self.headers)


@dataclass(frozen=True)
class CompletionRequest:
    """A validated request: what to decode and how."""

    prompt_ids: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    return_token_ids: bool


# ------------------------------------------------------------------------------------- parsing
def _num(body: dict[str, Any], key: str, default: float, lo: float, hi: float) -> float:
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= float(v) <= hi:
        raise ApiError(400, f"'{key}' must be a number in [{lo:g}, {hi:g}], got {v!r}", key)
    return float(v)


def _int(body: dict[str, Any], key: str, default: int | None, lo: int, hi: int) -> int | None:
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise ApiError(400, f"'{key}' must be an integer in [{lo}, {hi}], got {v!r}", key)
    return v


def parse_common(
    body: dict[str, Any], prompt_ids: list[int], max_context: int, chat: bool
) -> CompletionRequest:
    for key, is_noop in UNSUPPORTED.items():
        if key in body and not is_noop(body[key]):
            raise ApiError(400, f"'{key}' is not supported by this server", key)
    n = _int(body, "n", 1, 1, 1 << 30)
    if n != 1:
        raise ApiError(400, f"only n=1 is supported, got {n}", "n")
    if len(prompt_ids) >= max_context:
        raise ApiError(
            400,
            f"the prompt is {len(prompt_ids)} tokens; this model's context is {max_context}",
            "messages" if chat else "prompt",
            "context_length_exceeded",
        )
    room = max_context - len(prompt_ids)
    key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    default = room if chat else DEFAULT_COMPLETION_TOKENS
    max_tokens = _int(body, key, default, 1, 1 << 30)
    assert max_tokens is not None
    if max_tokens > room:
        raise ApiError(
            400,
            f"{key} {max_tokens} + the prompt's {len(prompt_ids)} tokens exceed the context of {max_context}",
            key,
            "context_length_exceeded",
        )
    stop = body.get("stop")
    stops: tuple[str, ...] = ()
    if isinstance(stop, str):
        stops = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = tuple(stop)
    elif stop is not None:
        raise ApiError(400, "'stop' must be a string or a list of strings", "stop")
    if len(stops) > MAX_STOP_STRINGS or any(not s or len(s) > MAX_STOP_CHARS for s in stops):
        raise ApiError(
            400, f"'stop': at most {MAX_STOP_STRINGS} non-empty strings of <= {MAX_STOP_CHARS} chars", "stop"
        )
    seed = _int(body, "seed", None, -(1 << 63), (1 << 64) - 1)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, "'stream' must be a boolean", "stream")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise ApiError(400, "'stream_options' must be an object", "stream_options")
    return CompletionRequest(
        prompt_ids=prompt_ids,
        max_tokens=max_tokens,
        temperature=_num(body, "temperature", 1.0, 0.0, 1e4),
        top_p=_num(body, "top_p", 1.0, 1e-9, 1.0),
        top_k=max(int(_int(body, "top_k", 0, -1, 1 << 30) or 0), 0),  # -1 (vLLM's "off") is 0 here
        seed=(seed % (1 << 63))
        if seed is not None
        else int.from_bytes(uuid.uuid4().bytes[:8], "little") >> 1,
        stop=stops,
        stream=stream,
        include_usage=bool(opts.get("include_usage", False)),
        return_token_ids=bool(body.get("return_token_ids", False)),
    )


def completion_prompt(body: dict[str, Any], target: Target) -> list[int]:
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]  # a batch of one
    if isinstance(p, str):
        return target.tokenizer.encode(p)
    if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        vocab = target.config.vocab_size
        if not all(0 <= t < vocab for t in p):
            raise ApiError(400, f"prompt token ids must be in [0, {vocab})", "prompt")
        return list(p)
    raise ApiError(400, "'prompt' must be one string or one list of token ids", "prompt")


def chat_prompt(body: dict[str, Any], target: Target) -> list[int]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise ApiError(400, "'messages' must be a non-empty list", "messages")
    clean = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "developer"):
            raise ApiError(400, f"messages[{i}] needs a role of system, user or assistant", "messages")
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(c, dict) and c.get("type") == "text" for c in content):
                raise ApiError(400, f"messages[{i}]: only text content is supported", "messages")
            content = "".join(str(c.get("text", "")) for c in content)
        if not isinstance(content, str):
            raise ApiError(400, f"messages[{i}].content must be a string", "messages")
        role = "system" if m["role"] == "developer" else m["role"]
        clean.append({"role": role, "content": content})
    try:
        text = target.tokenizer.apply_chat_template(clean, add_generation_prompt=True)
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
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            raise ApiError(400, "the body is not valid JSON", None, "invalid_json") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the body must be a JSON object", None, "invalid_json")
        return body

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        try:
            authorize(request)
            _, _, model = ready()
        except ApiError as exc:
            return exc.response()
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
            return exc.response()
        gen = Generation(engine, req, ctx.admission, who, ticket)
        gen.start()
        ctx.running += 1
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
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
            return ApiError(500, err, None, "internal_error", "server_error").response()
        usage = _usage(req, ids_out)
        if chat:
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": finish,
                "logprobs": None,
            }
        else:
            choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
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
                "usage": usage,
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
        return exc.response()


def _usage(req: CompletionRequest, ids_out: list[int]) -> dict[str, int]:
    return {
        "prompt_tokens": len(req.prompt_ids),
        "completion_tokens": len(ids_out),
        "total_tokens": len(req.prompt_ids) + len(ids_out),
    }


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
    obj = "chat.completion.chunk" if chat else "text_completion"

    def event(choice: dict[str, Any], usage: dict[str, int] | None = None) -> bytes:
        doc: dict[str, Any] = {"id": rid, "object": obj, "created": created, "model": model}
        doc["choices"] = [choice] if choice else []
        if usage is not None:
            doc["usage"] = usage
        return f"data: {json.dumps(doc, ensure_ascii=False)}\n\n".encode()

    def choice(piece: str, finish: str | None, new: list[int]) -> dict[str, Any]:
        c: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
        if chat:
            c["delta"] = {"content": piece} if piece or finish is None else {}
        else:
            c["text"] = piece
        if gen.req.return_token_ids:
            c["token_ids"] = new
        return c

    text = TextStream(target, gen.req.stop)
    ids: list[int] = []
    try:
        if chat:
            yield event({"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None})
        async for piece, new, fin, err in _tokens(gen, text, ctx):
            if err is not None:
                doc = {
                    "error": {"message": err, "type": "server_error", "param": None, "code": "internal_error"}
                }
                yield f"data: {json.dumps(doc)}\n\n".encode()
                break
            ids.extend(new)
            if piece or fin is not None or gen.req.return_token_ids:
                yield event(choice(piece, fin, new))
        if gen.req.include_usage:
            yield event({}, _usage(gen.req, ids))
        yield b"data: [DONE]\n\n"
    finally:  # also when the client goes away mid-stream: the engine drops the sequence
        gen.close()
        ctx.running -= 1
