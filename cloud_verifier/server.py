"""The FastAPI service: WS /v1/session, GET /healthz, /readyz, /metrics (DESIGN sections 3 and 7).

`create_app(config)` loads the target in the background (/readyz answers 503 until it is ready),
measures the verify cost curve, starts the engine loop and serves sessions. Each WebSocket has a
reader (frames into the session) and a writer (the session's outbox onto the socket); every
protocol decision lives in `shared.protocol`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import torch
from fastapi import FastAPI, WebSocket
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.websockets import WebSocketDisconnect

from cloud_verifier.auth import KeyStore
from cloud_verifier.config import ServerConfig
from cloud_verifier.cost import cached_verify_cost
from cloud_verifier.engine import Engine, EngineConfig
from cloud_verifier.metrics import Metrics
from cloud_verifier.model import Target, load_target
from cloud_verifier.session import CloseRequest, ModelInfo, Session
from shared.errors import CloseCode
from shared.messages import SessionLimits

log = logging.getLogger("cloud_verifier")

# the automatic KV pool takes at most this share of the weights' bytes (the 1.5B in fp32: ~0.85 GB,
# ~9,900 tokens with the CPU kernel's tiled keys), which keeps the process within 1.3x its weights
KV_WEIGHT_SHARE = 0.12


@dataclass
class AppState:
    config: ServerConfig
    keys: KeyStore
    metrics: Metrics = field(default_factory=Metrics)
    target: Target | None = None
    engine: Engine | None = None
    info: ModelInfo | None = None
    limits: SessionLimits | None = None
    load_error: str | None = None
    sessions: set[Session] = field(default_factory=set)

    @property
    def ready(self) -> bool:
        return self.engine is not None and self.engine.healthy()


def kv_blocks_for(config: ServerConfig, target: Target, memory_cap: int = 2 << 30) -> int:
    """Blocks for max_sessions full contexts, capped at `memory_cap` bytes of cache and at
    KV_WEIGHT_SHARE of the model's weight bytes (so a large target's pool does not outgrow it)."""
    if config.kv_blocks:
        return config.kv_blocks
    c = target.config
    per_token = 2 * c.num_layers * c.num_kv_heads * c.head_dim * torch.finfo(target.dtype).bits // 8
    if target.model.attention_kernel == "cpu-invariant" and config.block_size % 16 == 0:
        per_token = per_token * 3 // 2  # the CPU kernel's transposed copy of K
    weight_bytes = c.num_parameters() * torch.finfo(target.dtype).bits // 8
    cap = min(memory_cap, max(256 << 20, int(KV_WEIGHT_SHARE * weight_bytes)))
    tokens = min(config.max_sessions * (config.max_context + config.max_nodes + 1), cap // per_token)
    return max(tokens // config.block_size, 8)


async def _load(state: AppState, target: Target | None) -> None:
    cfg = state.config
    try:
        own = target is None  # a target passed in (tests, benches) keeps its unpacked weights
        if target is None:
            target = await asyncio.to_thread(
                load_target, cfg.model, cfg.dtype, cfg.device, True, cfg.attention
            )
        elif target.model.attention_mode != cfg.attention:
            target.model.set_attention(cfg.attention)
        # one copy of the weights: the packed projections replace the loaded ones
        await asyncio.to_thread(target.model.prepare, own, own)
        kv = target.new_kv_cache(kv_blocks_for(cfg, target), cfg.block_size)
        cost = {1: 1.0}
        if cfg.measure_cost:
            cost = await asyncio.to_thread(cached_verify_cost, target, kv, cfg.threads, cfg.remeasure_cost)
            log.info("verify cost curve (N nodes: ms): %s", cost)
        engine = Engine(
            target,
            kv,
            EngineConfig(token_budget=cfg.token_budget, max_context=cfg.max_context, batching=cfg.batching),
        )
        m = state.metrics

        def on_step(rows: int, sessions: int, seconds: float) -> None:
            m.forward_seconds.observe(seconds)
            m.step_rows.observe(rows)
            m.step_sessions.observe(sessions)
            m.kv_blocks_used.set(kv.blocks_in_use)

        engine.on_step = on_step
        m.kv_blocks_total.set(kv.num_blocks)
        state.limits = SessionLimits(
            max_nodes=cfg.max_nodes,
            max_depth=cfg.max_depth,
            max_pending=cfg.max_pending,
            max_bytes=cfg.max_bytes,
            max_context=cfg.max_context,
        )
        state.info = ModelInfo(
            model_id=target.model_id,
            vocab_size=target.config.vocab_size,
            vocab_fingerprint=target.vocab_fingerprint,
            eos_ids=tuple(target.eos_ids),
            verify_cost_ms=cost,
        )
        state.target = target
        engine.start_loop()
        state.engine = engine
        log.info("ready: model %s, %d KV blocks of %d tokens", target.model_id, kv.num_blocks, cfg.block_size)
    except Exception as exc:
        log.exception("loading the target failed")
        state.load_error = f"{type(exc).__name__}: {exc}"


def create_app(config: ServerConfig, target: Target | None = None) -> FastAPI:
    """The service. Pass `target` to serve an already-loaded model (tests, benches)."""
    state = AppState(config=config, keys=KeyStore.from_file(config.api_key_file, config.trust_anonymous))
    if config.threads:
        torch.set_num_threads(config.threads)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loader = asyncio.create_task(_load(state, target))
        yield
        loader.cancel()
        for s in list(state.sessions):
            s.close(CloseCode.GOING_AWAY, "server shutting down")
        if state.engine is not None:
            await state.engine.stop()

    app = FastAPI(title="cloud-verifier", lifespan=lifespan)
    app.state.verifier = state

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "alive"}

    @app.get("/readyz")
    async def readyz() -> Response:
        if state.ready:
            return JSONResponse({"status": "ready", "model": state.info.model_id if state.info else None})
        if state.load_error:
            detail = f"load failed: {state.load_error}"
        elif state.engine is None:
            detail = "loading the target model"
        else:
            detail = "engine loop stopped or stalled"
        return JSONResponse({"status": "not ready", "detail": detail}, status_code=503)

    @app.get("/metrics")
    async def metrics() -> Response:
        state.metrics.sessions.set(len(state.sessions))
        if state.engine is not None:
            state.metrics.kv_blocks_used.set(state.engine.kv.blocks_in_use)
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.websocket("/v1/session")
    async def session_ws(ws: WebSocket) -> None:
        await ws.accept()
        if not state.ready or state.engine is None or state.info is None or state.limits is None:
            await ws.close(CloseCode.TRY_AGAIN_LATER, "verifier not ready, try again later")
            return
        if len(state.sessions) >= config.max_sessions:
            state.metrics.rejected_sessions.inc()
            await ws.close(CloseCode.TRY_AGAIN_LATER, "try again later: server at max sessions")
            return
        auth = ws.headers.get("authorization", "")
        bearer = auth[7:].strip() if auth.lower().startswith("bearer ") else None
        session = Session(state.engine, state.info, state.limits, state.keys, state.metrics, bearer)
        state.sessions.add(session)
        state.metrics.sessions.set(len(state.sessions))
        writer = asyncio.create_task(_writer(ws, session))
        try:
            await _reader(ws, session, config)
        finally:
            session.close(CloseCode.GOING_AWAY, "connection closed")
            state.sessions.discard(session)
            state.metrics.sessions.set(len(state.sessions))
            with contextlib.suppress(Exception):
                await asyncio.wait_for(writer, timeout=5)
            writer.cancel()

    return app


async def _reader(ws: WebSocket, session: Session, config: ServerConfig) -> None:
    while not session.closed:
        timeout = None if session.generating else config.idle_timeout_s
        try:
            msg = await asyncio.wait_for(ws.receive(), timeout=timeout)
        except TimeoutError:
            if session.generating:
                continue
            session.close(CloseCode.GOING_AWAY, "idle timeout")
            return
        except WebSocketDisconnect:
            return
        if msg["type"] == "websocket.disconnect":
            return
        data = msg.get("bytes")
        if data is None:
            data = (msg.get("text") or "").encode()
            session.receive(b"\xc1" if data else data)  # text frames are not protocol frames
            continue
        session.receive(data)


async def _writer(ws: WebSocket, session: Session) -> None:
    try:
        while True:
            item = await session.outbox.get()
            if isinstance(item, CloseRequest):
                with contextlib.suppress(Exception):
                    await ws.close(item.code, item.reason)
                return
            await ws.send_bytes(item)
    except Exception:  # the peer went away: the reader sees the disconnect
        return


def serve(config: ServerConfig) -> None:
    """Run the service with uvicorn (message size limit -> close 1009, ping/pong keepalive)."""
    import uvicorn

    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    app = create_app(config)
    uvicorn.run(
        app,
        host=config.host,
        port=config.port,
        log_level=config.log_level,
        ws="websockets-sansio",
        ws_max_size=config.max_bytes,
        ws_ping_interval=config.ping_interval_s,
        ws_ping_timeout=config.ping_interval_s,
    )


class ThreadedServer:
    """The service on uvicorn in a daemon thread, on a free loopback port by default.

    For embedding the verifier next to other code, and for tests and benches that serve an
    already-loaded target: `with ThreadedServer(config, target) as srv: ... srv.url ...`.
    """

    def __init__(
        self, config: ServerConfig, target: Target | None = None, host: str = "127.0.0.1", port: int = 0
    ) -> None:
        import threading

        import uvicorn

        self.config = config
        self.app = create_app(config, target=target)
        self.server = uvicorn.Server(
            uvicorn.Config(
                self.app,
                host=host,
                port=port,
                log_level="warning",
                ws="websockets-sansio",
                ws_max_size=config.max_bytes,
                ws_ping_interval=config.ping_interval_s,
                ws_ping_timeout=config.ping_interval_s,
                lifespan="on",
                timeout_graceful_shutdown=10,
            )
        )
        self.thread = threading.Thread(target=self.server.run, name="verifier", daemon=True)
        self.host = host
        self.port = port

    @property
    def state(self) -> AppState:
        state: AppState = self.app.state.verifier
        return state

    @property
    def url(self) -> str:
        return f"ws://{self.host}:{self.port}/v1/session"

    @property
    def http(self) -> str:
        return f"http://{self.host}:{self.port}"

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

    def stop(self) -> None:
        """Stop serving; the lifespan stops the engine after its step in flight."""
        self.server.should_exit = True
        if self.thread.is_alive():
            self.thread.join(timeout=60)

    def __enter__(self) -> ThreadedServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
