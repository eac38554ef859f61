"""The FastAPI service: WS /v1/session, GET /healthz, /readyz, /health (vLLM's), /metrics
(docs/architecture.md §2, §7).

`create_app(config)` loads the target in the background (/readyz answers 503 until it is ready),
measures the verify cost curve, starts the engine loop and serves sessions (each WebSocket:
ws_endpoint.py's `serve_session`) and the OpenAI routes behind the HTTP gate (keys, drain:
`HttpGate`, at the end of this module); `serve` runs it under uvicorn with a graceful drain on
SIGTERM / SIGINT and reloads the key file on SIGHUP, `ThreadedServer` in a thread (tests, benches).

The gate in front of every HTTP route (ASGI middleware; WebSockets pass through: their key is
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
import logging
import signal
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Literal

import torch
import uvicorn
from fastapi import FastAPI, WebSocket
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cloud_verifier import logs, openai_api
from cloud_verifier.admission import Admission
from cloud_verifier.app_state import AppState
from cloud_verifier.auth import AuthError, KeyStore
from cloud_verifier.cost import cached_verify_cost
from cloud_verifier.engine import Engine
from cloud_verifier.http_protocol import with_header_timeout
from cloud_verifier.kv_pool import layers_budget_gb, pool_size
from cloud_verifier.live_cost import LiveCost
from cloud_verifier.resume import ParkedSessions
from cloud_verifier.server_config import ServerConfig
from cloud_verifier.session import ModelInfo
from cloud_verifier.step import EngineConfig
from cloud_verifier.ws_endpoint import serve_session
from shared.errors import CloseCode
from shared.model import Target, load_target
from shared.model.target import streamed_config
from shared.openai_compat import SSE_DONE, ApiError
from shared.openai_http import respond, sse_error

log = logging.getLogger("cloud_verifier")

# loads the target a config names, in place of `load_target` (--tensor-parallel N:
# cloud_verifier.parallel.load_for_service, which serve_parallel hands to `serve`)
TargetLoader = Callable[[ServerConfig], Target]


def load_configured(cfg: ServerConfig) -> Target:
    """The target a config names, with its dtype, device, attention, weights and offload."""
    offload = None if cfg.offload == "none" else cfg.offload
    resident_gb = cfg.resident_gb
    if offload is not None:  # the KV pool comes out of the budget first
        resident_gb, reserve = layers_budget_gb(cfg, streamed_config(cfg.model))
        log.info(
            "--resident-gb %.3f: the KV pool takes %.3f GB, the weights get %.3f GB",
            cfg.resident_gb,
            reserve / 1e9,
            resident_gb,
        )
    return load_target(
        cfg.model,
        cfg.dtype,
        cfg.device,
        True,
        cfg.attention,
        cfg.weights,
        offload,
        resident_gb,
        cfg.offload_threads,
    )


async def _load(state: AppState, target: Target | None, loader: TargetLoader | None = None) -> None:
    cfg = state.config
    try:
        own = target is None  # a target passed in (tests, benches) keeps its unpacked weights
        if target is None and loader is not None:
            target = await asyncio.to_thread(loader, cfg)
        elif target is None and cfg.tensor_parallel > 1:
            raise RuntimeError(
                f"--tensor-parallel {cfg.tensor_parallel} needs the ranks started first: run `cloud-verifier "
                "serve` (in code: pass cloud_verifier.parallel.load_for_service as the loader)"
            )
        elif target is None:
            target = await asyncio.to_thread(load_configured, cfg)
        elif target.model.attention_mode != cfg.attention:
            target.model.set_attention(cfg.attention)
        # one copy of the weights: the packed projections replace the loaded ones
        await asyncio.to_thread(target.model.prepare, own, own)
        size = pool_size(cfg, target)  # after the weights: what memory they leave
        log.info("%s", size.line())
        kv = target.new_kv_cache(size.blocks, cfg.block_size)
        cost = {1: 1.0}
        if cfg.measure_cost:
            cost = await asyncio.to_thread(cached_verify_cost, target, kv, cfg.threads, cfg.remeasure_cost)
            log.info("verify cost curve (N nodes: ms): %s", cost)
        engine = Engine(
            target,
            kv,
            EngineConfig(
                token_budget=cfg.token_budget,
                max_context=cfg.max_context,
                batching=cfg.batching,
                prefill_chunk=cfg.prefill_chunk,
                max_nodes=cfg.max_nodes,
            ),
        )
        m = state.metrics

        def on_step(rows: int, sessions: int, seconds: float) -> None:
            # (the engine has fed the forward to its live cost curve: engine.live_cost)
            m.forward_seconds.observe(seconds)
            m.record_cost(live.curve())
            m.step_rows.observe(rows)
            m.step_sessions.observe(sessions)
            m.record_pool(engine)

        engine.on_step = on_step
        group = getattr(target.model, "group", None)  # tensor parallelism: every rank must be alive
        if group is not None:
            engine.checks.append(group.alive)
        engine.cost_ms = {int(k): float(v) for k, v in cost.items()} if cfg.measure_cost else {}
        # the curve the welcome and verdicts advertise, refreshed from every step (live_cost.py);
        # without a measurement it starts from the {1: 1 ms} placeholder, and engine.cost_ms stays
        # empty (no curve: no batch wait)
        live = engine.live_cost = LiveCost(cost)
        m.record_cost(live.curve())
        m.kv_blocks_total.set(kv.num_blocks)
        state.limits = cfg.limits  # ServerConfig holds them to the rule clients read them by
        state.info = ModelInfo(
            model_id=target.model_id,
            vocab_size=target.config.vocab_size,
            vocab_fingerprint=target.vocab_fingerprint,
            eos_ids=tuple(target.eos_ids),
            verify_cost_ms=cost,
        )
        state.target = target
        m.model_name = target.model_id
        engine.start_loop()
        state.engine = engine
        log.info("ready: model %s, %d KV blocks of %d tokens", target.model_id, kv.num_blocks, cfg.block_size)
    except Exception as exc:
        state.load_error = f"{type(exc).__name__}: {exc}"
        log.error("cannot load the target model %r: %s", cfg.model, state.load_error)
        log.debug("loading the target failed", exc_info=True)
        if state.on_load_error is not None:
            state.on_load_error(state.load_error)


def _not_ready_detail(state: AppState) -> str:
    """Why /readyz answers 503."""
    if state.draining:
        return "draining: shutting down"
    if state.load_error:
        return f"load failed: {state.load_error}"
    if state.engine is None:
        return "loading the target model"
    group = getattr(state.target.model, "group", None) if state.target else None
    detail: str = getattr(group, "error", None) or "engine loop stopped or stalled"
    return detail


def _refresh_gauges(state: AppState, http_running: int) -> None:
    """The gauges /metrics reads at scrape time: sessions, pending trees, running generations
    (sessions generating + `http_running` OpenAI requests), waiting requests and the KV pool."""
    m = state.metrics
    m.sessions.set(len(state.sessions))
    m.cond_pending.set(sum(s.pending_trees for s in state.sessions))
    name = m.model_name
    m.vllm_running.labels(name).set(sum(1 for s in state.sessions if s.generating) + http_running)
    m.admission_waiting.set(state.admission.waiting)
    m.parked_sessions.set(len(state.parked))
    if state.engine is not None:
        m.record_pool(state.engine)
        m.vllm_waiting.labels(name).set(state.engine.waiting + state.engine.queued)


def create_app(
    config: ServerConfig, target: Target | None = None, loader: TargetLoader | None = None
) -> FastAPI:
    """The service. Pass `target` to serve an already-loaded model (tests, benches), or `loader`
    to load it in place of `load_target` (--tensor-parallel: rank 0's shard)."""
    state = AppState(
        config=config,
        keys=KeyStore.from_file(config.api_key_file, config.trust_anonymous),
        admission=Admission(config.max_sessions, config.max_waiting, config.queue_wait_s),
        parked=ParkedSessions(config.resume_keep_s, config.resume_tag, config.max_sessions),
    )
    if config.threads:
        torch.set_num_threads(config.threads)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.http_cut = asyncio.Event()  # of this event loop (an app may be served again)
        loading = asyncio.create_task(_load(state, target, loader))
        yield
        loading.cancel()
        for s in list(state.sessions):
            s.close(CloseCode.GOING_AWAY, "server shutting down")
        state.parked.close_all()
        if state.engine is not None:
            await state.engine.stop()
        api.tokenizers.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="cloud-verifier", lifespan=lifespan)
    app.state.verifier = state
    # with a key file, every HTTP route but OPEN_PATHS (the probes and /metrics) needs a key (FastAPI's
    # /docs, /redoc and /openapi.json included); the drain counts and ends HTTP requests there
    app.add_middleware(HttpGate, state=state)

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "alive"}

    @app.get("/health")
    async def health() -> Response:
        """vLLM's probe, which load tools validate a backend with: 200 with an empty body while
        serving (as /readyz), else 503."""
        return Response(status_code=200 if state.ready else 503)

    @app.get("/readyz")
    async def readyz() -> Response:
        if state.ready:
            return JSONResponse({"status": "ready", "model": state.info.model_id if state.info else None})
        return JSONResponse({"status": "not ready", "detail": _not_ready_detail(state)}, status_code=503)

    @app.get("/metrics")
    async def metrics() -> Response:
        _refresh_gauges(state, api.running)
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    origins = {o.strip() for o in config.allowed_origins.split(",") if o.strip()}
    api = openai_api.ApiContext(
        keys=state.keys,
        max_context=config.max_context,
        admission=state.admission,
        engine=lambda: state.engine if state.ready else None,
        target=lambda: state.target,
        model_id=lambda: state.info.model_id if state.info is not None else None,
        on_done=state.metrics.record_generation,
    )
    openai_api.install(app, api)

    @app.websocket("/v1/session")
    async def session_ws(ws: WebSocket) -> None:
        await serve_session(ws, state, origins)

    return app


async def drain(state: AppState, timeout_s: float) -> None:
    """Graceful shutdown: stop admitting (/readyz 503, new connections 1013, new HTTP requests 503),
    let running generations (sessions and HTTP requests) finish for up to `timeout_s`, then close
    every session with 1001 and a reason and end every HTTP request still running with an error
    (`HttpGate`)."""
    state.draining = True
    state.admission.close()  # new work refused, and the requests waiting for a slot at once
    deadline = time.monotonic() + timeout_s
    running = sum(1 for s in state.sessions if s.generating)
    log.info(
        "draining: %d sessions, %d generating, %d HTTP requests; up to %.0f s",
        len(state.sessions),
        running,
        state.http_running,
        timeout_s,
    )
    while True:
        for s in list(state.sessions):
            if not s.generating:  # between generations (or never started one): nothing to lose
                s.close(CloseCode.GOING_AWAY, "server draining: reconnect to another verifier")
        done = all(s.closed for s in state.sessions) and state.http_running == 0
        if done or time.monotonic() >= deadline:
            break
        await asyncio.sleep(0.05)
    if state.http_running:
        log.warning("drain timeout: ending %d HTTP requests with an error", state.http_running)
    state.http_cut.set()
    for s in list(state.sessions):
        s.close(CloseCode.GOING_AWAY, f"server shutting down: generation not finished within {timeout_s:g} s")
    await asyncio.sleep(0.2)  # the writers send the close frames, the gate the HTTP errors


def reload_keys(state: AppState) -> bool:
    """SIGHUP: read the key file again. New requests and sessions see the new keys; a file that
    cannot be read or parsed leaves the keys in use, with one log line saying why."""
    path = state.config.api_key_file
    if path is None:
        log.warning("SIGHUP: no --api-key-file to reload; access stays open")
        return False
    try:
        n = state.keys.reload(path)
    except (OSError, ValueError) as exc:
        log.error("SIGHUP: the key file was not reloaded, the keys in use stay: %s", exc)
        return False
    log.info("SIGHUP: reloaded %s: %d keys", path, n)
    return True


def uvicorn_config(
    app: FastAPI,
    config: ServerConfig,
    host: str,
    port: int,
    log_level: str,
    lifespan: Literal["on", "off"] = "on",
) -> uvicorn.Config:
    """uvicorn's settings for the service's app (`lifespan` "off": a second listener of an app
    whose lifespan runs elsewhere)."""
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        # uvicorn's default dictConfig would give its loggers handlers of their own, bound to the
        # stderr of the moment and bypassing logs.setup (--log-format json): they propagate instead
        log_config=None,
        http=with_header_timeout(config.header_timeout_s),
        h11_max_incomplete_event_size=MAX_HTTP_HEADER_BYTES,  # request line + headers
        ws="websockets-sansio",
        ws_max_size=config.max_bytes,
        ws_ping_interval=config.ping_interval_s,
        ws_ping_timeout=config.ping_interval_s,
        timeout_keep_alive=5,
        ssl_certfile=config.ssl_certfile,
        ssl_keyfile=config.ssl_keyfile,
        lifespan=lifespan,
        timeout_graceful_shutdown=5,
    )


# the request line and headers of one HTTP request (a WebSocket upgrade included)
MAX_HTTP_HEADER_BYTES = 64 << 10


def serve(config: ServerConfig, loader: TargetLoader | None = None) -> int:
    """Run the service with uvicorn until SIGINT / SIGTERM (drained: `drain`); a second signal exits
    at once. Returns the exit status: 1 when the model cannot be loaded (one line on stderr).
    `loader`: as `create_app`'s."""
    logs.setup(config.log_level, config.log_format)
    app = create_app(config, loader=loader)
    state: AppState = app.state.verifier
    uv_config = uvicorn_config(app, config, config.host, config.port, config.log_level)
    server = DrainingServer(uv_config, state, config.drain_timeout_s)
    state.on_load_error = lambda err: setattr(server, "should_exit", True)
    server.run()
    if state.load_error:
        print(f"cloud-verifier: cannot load model {config.model!r}: {state.load_error}", file=sys.stderr)
        return 1
    return 0


class DrainingServer(uvicorn.Server):
    """uvicorn's Server whose first exit signal drains the sessions and HTTP requests (`drain`)
    before shutting down, and whose SIGHUP reloads the key file (`reload_keys`; main thread only,
    where signals arrive)."""

    def __init__(self, config: uvicorn.Config, state: AppState, drain_timeout_s: float) -> None:
        super().__init__(config)
        self.state = state
        self.drain_timeout_s = drain_timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining: asyncio.Task[None] | None = None

    async def serve(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        hup = threading.current_thread() is threading.main_thread() and hasattr(signal, "SIGHUP")
        if hup:  # the default action of SIGHUP ends the process
            self._loop.add_signal_handler(signal.SIGHUP, reload_keys, self.state)
        try:
            await super().serve(sockets)
        finally:
            if hup:
                self._loop.remove_signal_handler(signal.SIGHUP)

    def handle_exit(self, sig: int, frame: Any) -> None:
        # a drain of 0 s still drains: what runs ends at once, with the errors a drain's deadline
        # gives, and the process exits 0
        if self._draining is not None or self._loop is None:
            super().handle_exit(sig, frame)  # a second signal: exit now
            return
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        if self._draining is None:
            self._draining = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        await drain(self.state, self.drain_timeout_s)
        self.should_exit = True


class ThreadedServer:
    """The service on uvicorn in a daemon thread, on a free loopback port by default.

    For embedding the verifier next to other code, and for tests and benches that serve an
    already-loaded target: `with ThreadedServer(config, target) as srv: ... srv.url ...`.
    """

    def __init__(
        self,
        config: ServerConfig,
        target: Target | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        loader: TargetLoader | None = None,
    ) -> None:
        self.config = config
        self.app = create_app(config, target=target, loader=loader)
        uv_config = uvicorn_config(self.app, config, host, port, "warning")
        self.server = DrainingServer(uv_config, self.state, config.drain_timeout_s)
        self.thread = threading.Thread(target=self.server.run, name="verifier", daemon=True)
        self.host = host
        self.port = port

    @property
    def state(self) -> AppState:
        state: AppState = self.app.state.verifier
        return state

    @property
    def url(self) -> str:
        scheme = "wss" if self.config.ssl_certfile else "ws"
        return f"{scheme}://{self.host}:{self.port}/v1/session"

    @property
    def http(self) -> str:
        scheme = "https" if self.config.ssl_certfile else "http"
        return f"{scheme}://{self.host}:{self.port}"

    def start(self, timeout: float = 300.0) -> ThreadedServer:
        """Start and wait until /readyz would answer 200 (RuntimeError if loading fails)."""
        import time

        self.thread.start()
        deadline = time.monotonic() + timeout
        while not (self.server.started and self.state.ready):
            if self.state.load_error or not self.thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the verifier did not get ready: {self.state.load_error or 'timeout'}")
            time.sleep(0.02)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    def drain(self) -> None:
        """What SIGTERM does to `serve`: drain (`drain`), then stop; returns at once."""
        self.server.handle_exit(signal.SIGTERM, None)

    def stop(self) -> None:
        """Stop serving, no drain; the lifespan stops the engine after its step in flight."""
        self.server.should_exit = True
        if self.thread.is_alive():
            self.thread.join(timeout=60)

    def __enter__(self) -> ThreadedServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# answered without a key and during a drain: health probes and metrics scrapes
OPEN_PATHS = frozenset({"/healthz", "/readyz", "/health", "/metrics"})


HTTP_SLACK = 16  # requests beyond the generations' slots and queue: reading bodies, /v1/models


# ---------------------------------------------------------------------------------------------------
# The HTTP gate


def max_http_requests(config: ServerConfig) -> int:
    return config.max_sessions + config.max_waiting + HTTP_SLACK


class HttpGate:
    """The middleware in front of every HTTP path but OPEN_PATHS: refuses a request while the server
    drains (503), without a valid key (401) or beyond max_http_requests (503), counts the requests
    running, and ends those the drain's deadline cuts. Its error bodies are OpenAI's, made as the
    routes make theirs (shared.openai_http: `respond`, and `sse_error` in a stream begun)."""

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
            err = ApiError(503, why, None, "draining", "server_error", {"Retry-After": "5"})
            await respond(err)(scope, receive, send)
            return
        try:
            state.keys.authenticate(_bearer(scope))
        except AuthError as exc:
            await respond(ApiError(401, str(exc), None, "invalid_api_key"))(scope, receive, send)
            return
        limit = max_http_requests(state.config)
        if state.http_running >= limit:
            why = f"the verifier has {limit} HTTP requests in flight: retry shortly or use another replica"
            err = ApiError(503, why, None, "overloaded", "server_error", {"Retry-After": "1"})
            await respond(err)(scope, receive, send)
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
            await respond(err)(scope, receive, send)
        elif _header(start, b"content-type").startswith(b"text/event-stream"):
            body = sse_error(err) + SSE_DONE
            await send({"type": "http.response.body", "body": body, "more_body": False})
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
