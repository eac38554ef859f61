"""`edge-client serve`: an OpenAI-compatible endpoint on the device, backed by the cloud verifier.

Apps that speak the OpenAI API point at `http://127.0.0.1:8080/v1`; each request drafts here (the
local draft model) and is verified in the cloud, so the answer is exactly the cloud target's.
`temperature` 0 is `greedy`, above it `match` (seeded: reproducible); an extra `mode` field asks
for `mss` / `rrs` where the key allows them. Responses carry `usage` and, in an extra `treespec`
field, the speculation's figures (tokens per round, rounds, pre-speculation hit rate, verify and
round-trip times). One generation runs at a time (the draft model is single-threaded); a few others
wait for it, each for a bounded time (ServeConfig).

The OpenAI routes, their errors, body limits and streams are shared.openai_http's; this module
supplies their generations (EdgeSource) and the live page. The endpoint spends the user's key, so
it answers only its own (shared.openai_http.guard: Host, Origin, Content-Type, body size). A
generation whose client goes away (a stream closed mid-answer, an abandoned request) is stopped,
and any failure is an OpenAI-style JSON error.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, Response

from edge_client.client import EdgeClient, GenerationError
from edge_client.web_edge import WebEdge
from shared.messages import Mode, Verdict
from shared.openai_compat import (
    ApiError,
    CompletionRequest,
    chat_messages,
    completion_prompt_value,
    parse_common,
    usage,
)
from shared.openai_http import (
    ClosingStream,
    CompletionSource,
    Generation,
    HttpConfig,
    Piece,
    check_model,
    client_gone,
    install,
    internal,
    read_json,
    respond,
    sse_data,
    valid_text,
    watch_disconnect,
)
from shared.protocol import ClientState

log = logging.getLogger(__name__)


NAME = "edge-client serve"


@dataclass(frozen=True)
class ServeConfig(HttpConfig):
    """The local endpoint's guards, body limits (HttpConfig) and queue (`edge-client serve` takes
    its defaults from here).

    max_waiting:    requests that may wait behind the running generation; one more gets 429
    wait_s:         the longest a request waits for the running generation (then 503)
    mode:           the mode of a request without a `mode` field ("auto": the SDK's planner)
    objective:      what mode auto plans for: "latency" or "cost"
    """

    ORIGIN_OPTION: ClassVar[str] = "edge-client serve --allow-origin"

    max_waiting: int = 8
    wait_s: float = 300.0
    mode: str = "auto"
    objective: str = "latency"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_waiting < 0 or not self.wait_s > 0:
            raise ValueError("max_waiting must be >= 0 and wait_s > 0")


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
            raise client_gone()
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


class EdgeSource(CompletionSource):
    """The OpenAI routes' generations on the edge: each waits for the draft model (EdgeSession),
    drafts here and is verified over the endpoint's one verifier session."""

    name = NAME
    owned_by = "treespec (verified in the cloud)"

    def __init__(self, edge: EdgeSession) -> None:
        self.edge = edge
        self.config = edge.config

    async def model(self, request: Request) -> str:
        return await self.edge.model()

    async def start(
        self, admitted: Any, body: dict[str, Any], chat: bool, gone: asyncio.Task[None]
    ) -> Generation:
        """Wait for the draft model, check the request against the session, begin the generation."""
        edge = self.edge
        await edge.acquire(gone)
        c: EdgeClient | None = None
        try:
            c = await edge.session()
            req, mode, model = _parse(body, chat, c, edge.config.mode)
            if gone.done():
                raise client_gone()
        except ApiError:
            edge.release(c)
            raise
        except Exception:
            log.exception("edge-client serve: reading a request")
            edge.release(c, failed=True)
            raise internal(NAME, "reading the request") from None
        return _generation(edge, c, req, mode, model)


def _generation(
    edge: EdgeSession, c: EdgeClient, req: CompletionRequest, mode: Mode | str, model: str
) -> Generation:
    """The generation over session `c`; its end releases the draft model (EdgeSession.release)."""
    pieces = _generate(c, req, mode, edge.config.objective)

    def end(failed: bool) -> asyncio.Task[None]:
        async def stop() -> bool:
            await pieces.aclose()  # if the client left at a yield: the generation stops here
            return failed

        return edge.release(c, failed, stop=stop)

    def counts() -> dict[str, int] | None:
        return None if c.last is None else usage(len(req.prompt_ids), len(c.last.tokens))

    return Generation(req, model, pieces, end, counts, lambda: {"treespec": speculation_stats(c)})


def create_app(
    make_client: Callable[[], EdgeClient], config: ServeConfig | None = None, web: WebEdge | None = None
) -> FastAPI:
    """The local API over one verifier session (opened on the first request, reopened if it drops),
    behind the guards (ServeConfig); with `web`, the browser edge's page and files at /edge/
    (edge_client.web_edge)."""
    cfg = config or ServeConfig()
    app = FastAPI(title="edge-client serve")
    edge = EdgeSession(make_client, cfg)
    app.state.edge = edge
    install(app, EdgeSource(edge), guard=True)
    live = _LiveRoutes(edge, cfg)
    app.get("/healthz")(live.healthz)
    app.get("/")(live.page)
    app.post("/live")(live.live)
    if web is not None:
        web.mount(app)
    return app


class _LiveRoutes:
    """The live page and its stream, and /healthz, over the one EdgeSession of an app."""

    def __init__(self, edge: EdgeSession, cfg: ServeConfig) -> None:
        self.edge = edge
        self.cfg = cfg

    async def healthz(self) -> dict[str, str]:
        return {"status": "alive"}

    async def page(self) -> Response:
        return HTMLResponse(LIVE_PAGE.read_text(encoding="utf-8"))

    async def live(self, request: Request) -> Response:
        """The page's stream: per verdict, its tokens with how each came, and the running figures."""
        try:
            body = await read_json(request, self.cfg)
            prompt, n = _live_request(body)
        except ApiError as exc:
            return respond(exc)
        edge = self.edge
        gone = watch_disconnect(request)
        try:
            await edge.acquire(gone)
        except ApiError as exc:
            gone.cancel()
            return respond(exc)
        c: EdgeClient | None = None
        try:
            c = await edge.session()
            if gone.done():
                raise client_gone()
        except ApiError as exc:
            edge.release(c)
            return respond(exc)
        finally:
            gone.cancel()
        mode = Mode.AR if body.get("cloud_only") else Mode.GREEDY
        return ClosingStream(_live(c, prompt, n, mode, edge))


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
    check_model(body, model)
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
        events.put_nowait(sse_data(doc))

    async def produce() -> None:
        nonlocal failed
        try:
            gen = c.generate(prompt, max_new_tokens=n, mode=mode, on_verdict=on_verdict)
            async with contextlib.aclosing(gen):
                async for _ in gen:
                    pass
            events.put_nowait(sse_data({"done": True, "stats": speculation_stats(c)}))
        except GenerationError as exc:
            events.put_nowait(sse_data({"error": str(exc)}))
        except Exception:
            failed = True
            log.exception("edge-client serve: a live generation failed")
            msg = "the generation failed inside edge-client serve (see its log)"
            events.put_nowait(sse_data({"error": msg}))
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
) -> AsyncGenerator[Piece, None]:
    """The generation's text pieces, the finish reason on the last (a verifier's failure: 502)."""
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
    try:
        async with contextlib.aclosing(gen):  # closed here, not later by the garbage collector
            async for piece in gen:
                yield Piece(piece)
    except GenerationError as exc:
        raise ApiError(502, str(exc), exc.field, "verifier_error", "server_error") from None
    last = c.last
    reason = last.reason if last is not None else None
    yield Piece("", "length" if reason in ("length", "context") else "stop")


__all__ = ["EdgeSession", "EdgeSource", "ServeConfig", "create_app", "speculation_stats"]
