"""OpenAI-compatible HTTP API on the verifier: /v1/completions, /v1/chat/completions, /v1/models,
and vLLM's /tokenize, /detokenize and /version (vllm_api).

Each request is one target-only generation (mode `ar`) in the same engine as the speculative
sessions, so it is batched with them step by step. Sampling is the verifier's: temperature 0 is
greedy, and a seeded request samples with the keyed sampler, so it emits exactly the tokens of a
seeded `ar` session (and of a seeded `match` one). Errors have OpenAI's body:
`{"error": {"message", "type", "param", "code"}}`.

What a request may cost is bounded before it runs: the prompt is rendered and tokenized on a
small worker pool (never on the event loop), after a cheap check that refuses a text too long to
fit the context (`PromptBound`); a key's `tokens_per_min` is charged the prompt plus `max_tokens`
at admission and refunded what was not generated; a client that goes away ends its generation,
freeing its slot and KV cache at once (a stream's, and a whole answer's while it is collected).

The routes, their errors, body limits and streams are shared.openai_http's (as the edge's local
endpoint's); this module supplies their generations (VerifierSource) and vLLM's utility routes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from cloud_verifier import vllm_api
from cloud_verifier.admission import Admission, AdmissionRefused, Ticket
from cloud_verifier.auth import AuthError, KeyStore, Principal
from cloud_verifier.engine import Engine
from cloud_verifier.step import RoundResult
from shared.messages import Mode, Prompt
from shared.model import Target
from shared.openai_compat import (
    ApiError,
    CompletionRequest,
    chat_messages,
    completion_prompt_value,
    parse_common,
    parse_json_body,
    text_bytes,
)
from shared.openai_http import (
    CompletionSource,
    Generation,
    HttpConfig,
    Piece,
    check_model,
    read_json,
    respond,
    until_gone,
)
from shared.openai_http import install as install_openai

TOKENIZE_WORKERS = 2  # prompts rendered and tokenized at once (the rest queue for a worker)


def _byte_level_chars() -> dict[int, str]:
    """GPT-2's byte-level alphabet: the character that stands for each byte in a BPE vocabulary."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = {b: chr(b) for b in printable}
    for n, b in enumerate(b for b in range(256) if b not in chars):
        chars[b] = chr(256 + n)
    return chars


@dataclass(frozen=True)
class PromptBound:
    """A lower bound on a text's token count that costs one pass over its bytes, for byte-level BPE
    tokenizers: each byte of the text is one character of the BPE alphabet and a token covers at
    most `bytes_per_token` of them, so a text of B bytes is at least B / bytes_per_token tokens.
    Bytes whose character is not in the vocabulary are dropped by the tokenizer (no unknown token),
    so they are not counted. A text refused by this bound is longer than the context however it
    tokenizes: no prompt that fits is ever refused by it."""

    bytes_per_token: int  # the longest token, in UTF-8 bytes of its text (>= the bytes it covers)
    dropped: bytes  # bytes the tokenizer drops (their alphabet character is not in the vocabulary)

    def min_tokens(self, text: str) -> int:
        kept = len(text.encode("utf-8").translate(None, self.dropped))
        return -(-kept // self.bytes_per_token)

    @classmethod
    def of(cls, tokenizer: Any) -> PromptBound | None:
        """The bound of a `tokenizers.Tokenizer`, or None where the reasoning does not hold: a
        normalizer (may rewrite or delete text), a pre-tokenizer that may remove text, a model that
        is not BPE, an unknown token (one may stand for any run of text), or an added token that
        strips the whitespace beside it."""
        spec = json.loads(tokenizer.to_str())
        model = spec.get("model") or {}
        if spec.get("normalizer") is not None or model.get("type") != "BPE" or model.get("unk_token"):
            return None
        pre = spec.get("pre_tokenizer") or {}
        parts = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
        kinds = [p.get("type") for p in parts]
        if "ByteLevel" not in kinds or not set(kinds) <= {"ByteLevel", "Digits", "Split", "Punctuation"}:
            return None
        if any(p.get("behavior") == "Removed" for p in parts):
            return None
        if any(a.get("lstrip") or a.get("rstrip") for a in spec.get("added_tokens") or []):
            return None
        vocab = tokenizer.get_vocab(with_added_tokens=True)
        dropped = bytes(b for b, c in _byte_level_chars().items() if c not in vocab)
        return cls(max(len(t.encode("utf-8")) for t in vocab), dropped)


def _fits(text: str, bound: PromptBound | None, max_context: int, param: str) -> None:
    if bound is not None and (least := bound.min_tokens(text)) >= max_context:
        raise ApiError(400, f"the prompt is at least {least} tokens ({text_bytes(text, param)} bytes); this "
                       f"model's context is {max_context}", param, "context_length_exceeded")  # fmt: skip


INLINE_JSON_BYTES = 64 << 10  # bodies up to this size are parsed on the event loop (< 1 ms)
HTTP = HttpConfig()  # the body limits (openai_compat's MAX_BODY_BYTES, BODY_TIMEOUT_S)


def completion_prompt(
    body: dict[str, Any], target: Target, max_context: int | None = None, bound: PromptBound | None = None
) -> list[int]:
    """/v1/completions' prompt as token ids (CPU work: call it off the event loop)."""
    p = completion_prompt_value(body, target.config.vocab_size, max_context)
    if isinstance(p, list):
        return p
    if max_context is not None:
        _fits(p, bound, max_context, "prompt")
    return _encode(target, p, add_special=True)


def chat_prompt(
    body: dict[str, Any], target: Target, max_context: int | None = None, bound: PromptBound | None = None
) -> list[int]:
    """/v1/chat/completions' messages through the chat template, as token ids (CPU work: call it
    off the event loop)."""
    try:
        text = target.tokenizer.apply_chat_template(chat_messages(body), add_generation_prompt=True)
    except ApiError:
        raise
    except Exception as exc:
        raise ApiError(400, f"the chat template failed on these messages: {exc}", "messages") from None
    if max_context is not None:
        _fits(text, bound, max_context, "messages")
    return _encode(target, text, add_special=False)


def _encode(target: Target, text: str, add_special: bool) -> list[int]:
    """`TargetTokenizer.encode`'s ids. `encode_batch` lets go of the GIL while it works (`encode`
    holds it for the whole call), so the event loop runs while a tokenize worker is busy."""
    (enc,) = target.tokenizer.tokenizer.encode_batch([text], add_special_tokens=add_special)
    return list(enc.ids)


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
        self._prefix = 0  # ids[_prefix:_read] decode to the end of `text` (both whole characters)
        self._read = 0  # ids[:_read] are in `text`

    def add(self, ids: Sequence[int]) -> str:
        """Append tokens; returns the newly final text (may be empty).

        Only the tokens since the last two points where the text was whole are decoded (vLLM's
        incremental detokenization): decoding the whole output for each token was quadratic, 1.5 s
        of the event loop for a 4,000-token answer. The window starts one step back so that a
        decoder which treats a text's first token apart (drops its leading space) sees the same
        start in both decodes; the difference of the two is the new text."""
        self.ids.extend(int(t) for t in ids if int(t) not in self.special)
        before = self.tok.decode(self.ids[self._prefix : self._read], skip_special=True)
        window = self.tok.decode(self.ids[self._prefix :], skip_special=True)
        if window.endswith("\ufffd"):
            return ""
        if window.startswith(before):
            self.text += window[len(before) :]
        else:  # a decoder that is not local: the whole text again (never for byte-level BPE)
            self.text = self.tok.decode(self.ids, skip_special=True)
        self._prefix, self._read = self._read, len(self.ids)
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
class CompletionRun:
    """One request's target-only generation in the engine. Its key was charged the prompt and
    max_tokens at admission; `close` frees the engine sequence and the slot and refunds the tokens
    not generated (whether it finished, failed, or its client went away)."""

    engine: Engine
    req: CompletionRequest
    admission: Admission
    who: Principal
    ticket: Ticket
    on_close: Callable[[], None] | None = None
    results: asyncio.Queue[RoundResult] = field(default_factory=asyncio.Queue)
    ended: bool = False
    generated: int = 0

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
        self.engine.start(self.seq, prompt, prompt.tokens, ignore_eos=r.ignore_eos)

    def _on_result(self, res: RoundResult) -> None:
        self.results.put_nowait(res)
        self.generated += len(res.tokens)
        if not res.done and not self.ended:
            self.engine.submit(self.seq, 0, None)

    def close(self) -> None:
        if not self.ended:
            self.ended = True
            self.engine.close(self.seq)
            self.seq.on_result = _ignore
            self.admission.refund(self.who, max(0, self.req.max_tokens - self.generated))
            self.admission.release(self.ticket)
            if self.on_close is not None:
                self.on_close()

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
    # prompts are rendered and tokenized here, never on the event loop
    tokenizers: concurrent.futures.ThreadPoolExecutor = field(
        default_factory=lambda: concurrent.futures.ThreadPoolExecutor(TOKENIZE_WORKERS, "tokenize")
    )
    _bound: tuple[Target, PromptBound | None] | None = None

    def bound(self, target: Target) -> PromptBound | None:
        """The target's PromptBound (computed once, on a tokenize worker)."""
        if self._bound is None or self._bound[0] is not target:
            self._bound = (target, PromptBound.of(target.tokenizer.tokenizer))
        return self._bound[1]


class VerifierSource(CompletionSource):
    """The OpenAI routes' generations on the verifier: a key and a loaded target before the body is
    read; then the prompt tokenized, charged and admitted, and generated target-only (mode `ar`)."""

    name = "the verifier"
    config = HTTP

    def __init__(self, ctx: ApiContext) -> None:
        self.ctx = ctx

    async def admit(self, request: Request) -> tuple[Principal, Engine, Target, str]:
        who = _authorize(self.ctx, request)
        return (who, *_ready(self.ctx))

    async def parse(self, raw: bytes) -> dict[str, Any]:
        return await _parse_body(self.ctx, raw)

    async def model(self, request: Request) -> str:
        _authorize(self.ctx, request)
        return _ready(self.ctx)[2]

    async def start(
        self,
        admitted: tuple[Principal, Engine, Target, str],
        body: dict[str, Any],
        chat: bool,
        gone: asyncio.Task[None],
    ) -> Generation:
        """From here the client may go away at any moment (while its prompt is tokenized, while it
        waits for a slot): then the work stops, and a generation that began all the same ends."""
        who, engine, target, model = admitted
        check_model(body, model)
        work = _begin(self.ctx, body, who, engine, target, model, chat)
        return await until_gone(work, gone, lambda late: late.end())


def install(app: FastAPI, ctx: ApiContext) -> None:
    """Add the OpenAI-compatible routes (shared.openai_http over VerifierSource) and vLLM's
    utility routes to `app`."""
    install_openai(app, VerifierSource(ctx))

    # vLLM's utility routes (vllm_api), for tools written for vLLM
    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        return await _utility(ctx, request, lambda b, t: vllm_api.tokenize(b, t, ctx.max_context, _encode))

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        return await _utility(ctx, request, vllm_api.detokenize)

    @app.get("/version")
    async def version(request: Request) -> Response:
        try:
            _authorize(ctx, request)
        except ApiError as exc:
            return respond(exc)
        return JSONResponse(vllm_api.version())


async def _utility(
    ctx: ApiContext, request: Request, work: Callable[[dict[str, Any], Target], dict[str, Any]]
) -> Response:
    """POST /tokenize and /detokenize: a key, a loaded target and a body as the generation routes
    take them, then `work` on a tokenize worker (a 4 MiB prompt never holds up the event loop)."""
    try:
        _authorize(ctx, request)
        _, target, model = _ready(ctx)
        body = await read_json(request, HTTP, lambda raw: _parse_body(ctx, raw))
        check_model(body, model)
        answer = await asyncio.get_running_loop().run_in_executor(ctx.tokenizers, work, body, target)
    except ApiError as exc:
        return respond(exc)
    return JSONResponse(answer)


def _authorize(ctx: ApiContext, request: Request) -> Principal:
    """The key of the request's `Authorization: Bearer` header (401 when it is refused)."""
    auth = request.headers.get("authorization", "")
    key = auth[7:].strip() if auth.lower().startswith("bearer ") else None
    try:
        return ctx.keys.authenticate(key)
    except AuthError as exc:
        raise ApiError(401, str(exc), None, "invalid_api_key") from None


def _ready(ctx: ApiContext) -> tuple[Engine, Target, str]:
    """The engine, target and model id once the target is loaded (503 until then)."""
    engine, target, model = ctx.engine(), ctx.target(), ctx.model_id()
    if engine is None or target is None or model is None:
        raise ApiError(
            503, "the verifier is not ready", None, "not_ready", "server_error", {"Retry-After": "5"}
        )
    return engine, target, model


async def _parse_body(ctx: ApiContext, raw: bytes) -> dict[str, Any]:
    """A body as a JSON object; a large one is parsed on a tokenize worker: the event loop (every
    session) keeps its turn."""
    if len(raw) <= INLINE_JSON_BYTES:
        return parse_json_body(raw)
    return await asyncio.get_running_loop().run_in_executor(ctx.tokenizers, parse_json_body, raw)


async def _prompt_ids(ctx: ApiContext, body: dict[str, Any], target: Target, chat: bool) -> list[int]:
    """Render and tokenize on a tokenize worker: the event loop, and every other request and
    session, keep running while a 4 MiB prompt is worked through."""

    def work() -> list[int]:
        bound = ctx.bound(target)
        if chat:
            return chat_prompt(body, target, ctx.max_context, bound)
        return completion_prompt(body, target, ctx.max_context, bound)

    return await asyncio.get_running_loop().run_in_executor(ctx.tokenizers, work)


def _charge(who: Principal, req: CompletionRequest, body: dict[str, Any], chat: bool) -> CompletionRequest:
    """The request as its key's tokens_per_min can pay for it: a default max_tokens is cut to
    what the key may spend in a minute; a request that could never be paid is a 400."""
    limit = who.tokens_per_min
    if limit is None:
        return req
    n = len(req.prompt_ids)
    if n >= limit:
        raise ApiError(400, f"the prompt is {n} tokens; this key may use at most {limit} tokens per "
                       "minute (prompt and output)", "messages" if chat else "prompt",
                       "request_too_large")  # fmt: skip
    key = "max_tokens"
    if chat and body.get("max_completion_tokens") is not None:
        key = "max_completion_tokens"
    if body.get(key) is None:
        return dataclasses.replace(req, max_tokens=min(req.max_tokens, limit - n))
    if n + req.max_tokens > limit:
        raise ApiError(400, f"the prompt's {n} tokens + {key} {req.max_tokens} exceed this key's limit "
                       f"of {limit} tokens per minute", key, "request_too_large")  # fmt: skip
    return req


async def _begin(
    ctx: ApiContext,
    body: dict[str, Any],
    who: Principal,
    engine: Engine,
    target: Target,
    model: str,
    chat: bool,
) -> Generation:
    """Tokenize, charge and admit the request, then start its generation."""
    ids = await _prompt_ids(ctx, body, target, chat)
    req = _charge(who, parse_common(body, ids, ctx.max_context, chat, ignore_eos=True), body, chat)
    try:
        ticket = await ctx.admission.acquire(who, len(req.prompt_ids) + req.max_tokens)
    except AdmissionRefused as exc:
        raise ApiError(429, exc.reason, None, "rate_limit_exceeded", "rate_limit_error",
                       {"Retry-After": str(exc.retry_after_s)}) from None  # fmt: skip

    def closed() -> None:
        ctx.running -= 1

    run = CompletionRun(engine, req, ctx.admission, who, ticket, on_close=closed)
    run.start()
    ctx.running += 1
    pieces = _pieces(run, TextStream(target, req.stop), ctx)
    return Generation(req, model, pieces, lambda failed: run.close(), token_ids=req.return_token_ids)


async def _pieces(run: CompletionRun, text: TextStream, ctx: ApiContext) -> AsyncGenerator[Piece, None]:
    """The new text, token ids and finish reason per engine result (an engine error: 500)."""
    t0 = time.perf_counter()
    first: float | None = None
    async for res in run.stream():
        if res.error is not None:
            raise ApiError(500, res.error.message, None, "internal_error", "server_error")
        if first is None:
            first = time.perf_counter() - t0
        piece = text.add(res.tokens)
        finish = None
        if text.stopped:
            finish = "stop"
        elif res.done:
            finish = "length" if res.reason in ("length", "context") else "stop"
            piece += text.finish()
        yield Piece(piece, finish, list(res.tokens))
        if finish is not None:
            break
    if ctx.on_done is not None and first is not None:
        ctx.on_done(first, len(text.ids), time.perf_counter() - t0)
