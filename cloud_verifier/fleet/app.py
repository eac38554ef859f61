"""The verifier as a Ray Serve deployment: `Verifier` replicas, each today's engine and ASGI app
(`cloud_verifier.server.create_app`) behind Serve's proxy, and `build_app`, the application
builder a Serve config names (`import_path: cloud_verifier.fleet.app:build_app`).

A replica builds its app in the replica process (`__serve_build_asgi_app__`, Serve's late-bound
ingress), from its own `ServerConfig` (`config.replica_config`), and is ready only once its target
is loaded and its engine runs: the app's lifespan waits for the load, so Serve routes no session to
a replica still loading, and a replica whose load fails never starts (Serve retries it). With
`direct` it also listens on an address of its own, offered to clients (`direct.py`). Its health
check fails once its engine stops or stalls. Every second it reports its sessions, queue and
metrics to the fleet's board (`status.py`), and its `/metrics` answers with every live replica's,
labelled by replica and node (`metrics.py`): one scrape of the fleet's address sees the fleet.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from typing import Any

import ray
from fastapi import FastAPI
from fastapi.responses import Response
from fastapi.routing import APIRoute
from prometheus_client import CONTENT_TYPE_LATEST
from ray import serve
from ray.serve import Application, Deployment

from cloud_verifier.app_state import AppState
from cloud_verifier.fleet.config import DEPLOYMENT_NAME, DirectOptions, FleetArgs, replica_config
from cloud_verifier.fleet.direct import DirectListener
from cloud_verifier.fleet.metrics import ReplicaMetrics, bound, merge
from cloud_verifier.fleet.status import ReplicaStats, board, replica_stats

log = logging.getLogger("cloud_verifier.fleet")

REPORT_EVERY_S = 1.0  # how often a replica tells the board its sessions, queue and metrics
BOARD_WAIT_S = 5.0  # the fleet's /metrics waits this long for the board, then shows this replica's


class VerifierReplica:
    """One replica: the verifier service of `cloud-verifier serve` on this replica's ServerConfig
    (its CLOUD_VERIFIER_<FIELD> variables, then `overrides`)."""

    def __init__(self, overrides: dict[str, Any], direct: DirectOptions | None = None) -> None:
        # its resume tokens name this replica, so that the fleet's router sends a resume here
        tag = serve.get_replica_context().replica_id.unique_id
        self.config = replace(replica_config(overrides), resume_tag=tag)
        self.direct = direct  # its own address, offered to clients (direct.py); None: none
        self.state: AppState | None = None

    def __serve_build_asgi_app__(self) -> FastAPI:
        from cloud_verifier.server import create_app

        close_group = None
        loader = None
        if self.config.tensor_parallel > 1:  # its other ranks: child processes of this replica
            from cloud_verifier.parallel.service import load_for_service, start_group

            self.config, group = start_group(self.config)
            close_group, loader = group.close, load_for_service
        app = create_app(self.config, loader=loader)
        state: AppState = app.state.verifier
        self.state = state
        link = _BoardLink(_own_metrics(app))
        app.get("/metrics")(link.fleet_metrics)
        serving = app.router.lifespan_context

        @contextlib.asynccontextmanager
        async def lifespan(app: FastAPI) -> AsyncIterator[None]:
            async with serving(app):
                await _loaded(state)
                listener = await _listen(app, state, self.direct)
                reporter = asyncio.create_task(_report(state, link))
                try:
                    yield
                finally:
                    reporter.cancel()
                    if listener is not None:
                        state.direct = None
                        await listener.stop()
                    if close_group is not None:
                        close_group()

        app.router.lifespan_context = lifespan
        return app

    def check_health(self) -> None:
        """Serve's periodic check: fails when the engine loop stopped or stalled (the replica is
        then replaced); a draining replica is still healthy."""
        state = self.state
        if state is None or state.draining:
            return
        if state.load_error:
            raise RuntimeError(f"cannot load the target model: {state.load_error}")
        if state.engine is not None and not state.engine.healthy():
            raise RuntimeError("the verifier's engine loop stopped or stalled")

    def record_routing_stats(self) -> dict[str, int]:
        """What the fleet's router reads of this replica (`router.py`): its sessions, queue,
        sessions kept for a resume and room for more sessions (slots its admission has free,
        waiting requests counted against them)."""
        stats = replica_stats(self.state)
        state = self.state
        parked = len(state.parked) if state is not None else 0
        room = 0
        if state is not None:
            a = state.admission
            room = max(0, a.capacity - a.in_use - a.waiting)
        return {"sessions": stats["sessions"], "queue": stats["queue"], "parked": parked, "room": room}

    def stats(self) -> ReplicaStats:
        """This replica's sessions and queue (also what it reports to the board)."""
        return replica_stats(self.state)


async def _loaded(state: AppState) -> None:
    """Wait until the target is loaded and the engine runs; a failed load is an error (the replica
    does not start)."""
    while state.engine is None:
        if state.load_error:
            raise RuntimeError(f"cannot load the target model {state.config.model!r}: {state.load_error}")
        await asyncio.sleep(0.05)


async def _listen(app: FastAPI, state: AppState, options: DirectOptions | None) -> DirectListener | None:
    """The replica's own address, listening and offered to clients (None without `options`)."""
    if options is None:
        return None
    listener = DirectListener(app, state.config, options)
    await listener.start()
    node: Callable[[], str] = ray.util.get_node_ip_address  # (untyped in Ray)
    state.direct = listener.url(node())
    log.info("replica listening on its own address %s", state.direct)
    return listener


async def _report(state: AppState, link: _BoardLink) -> None:
    """Tell the fleet's board this replica's stats and metrics every REPORT_EVERY_S, until
    cancelled."""
    replica = serve.get_replica_context().replica_id.unique_id
    while True:
        try:
            the_board = await link.board()
            await the_board.report.remote(replica, replica_stats(state))
            await the_board.report_metrics.remote(await link.own())
        except _BOARD_ERRORS as exc:
            link.lost(exc)
        await asyncio.sleep(REPORT_EVERY_S)


# the board restarted or is gone (looked up again next time), or is a board of an earlier release,
# without report_metrics (it lives as long as the cluster)
_BOARD_ERRORS = (ray.exceptions.RayError, AttributeError, TimeoutError)


def _own_metrics(app: FastAPI) -> Callable[[], Awaitable[Response]]:
    """Take the app's `/metrics` route off it; returns its handler (this replica's own metrics,
    as `cloud-verifier serve` answers them)."""
    for route in app.router.routes:
        if isinstance(route, APIRoute) and route.path == "/metrics":
            app.router.routes.remove(route)
            handler: Callable[[], Awaitable[Response]] = route.endpoint
            return handler
    raise RuntimeError("the verifier's app has no /metrics route")


class _BoardLink:
    """A replica's line to the fleet's board: the board's handle (looked up when first needed and
    after a failed call) and this replica's own metrics (`render`: its app's /metrics handler)."""

    def __init__(self, render: Callable[[], Awaitable[Response]]) -> None:
        self.render = render
        self._board: Any = None

    async def board(self) -> Any:
        if self._board is None:
            self._board = await asyncio.to_thread(board)  # (a lookup in Ray's control store)
        return self._board

    def lost(self, exc: BaseException) -> None:
        log.warning("cannot reach the fleet's board: %s: %s", type(exc).__name__, exc)
        self._board = None

    async def own(self) -> ReplicaMetrics:
        """This replica's metrics now, named by Serve's replica id and its node's IP."""
        text = bytes((await self.render()).body).decode()
        replica = serve.get_replica_context().replica_id.unique_id
        node: Callable[[], str] = ray.util.get_node_ip_address  # (untyped in Ray)
        return bound(ReplicaMetrics(replica, node(), text))

    async def fleet_metrics(self) -> Response:
        """The fleet's `/metrics`: every live replica's metrics, each sample labelled `replica`
        and `node` (this replica's rendered now, the others' as they last reported); this replica's
        alone, with a comment, when the board does not answer within BOARD_WAIT_S."""
        mine = await self.own()
        others: list[ReplicaMetrics] = []
        notes: list[str] = []
        try:
            async with asyncio.timeout(BOARD_WAIT_S):
                the_board = await self.board()
                others = await the_board.metrics.remote()
        except _BOARD_ERRORS as exc:
            self.lost(exc)
            notes.append(
                f"this replica's metrics alone: the fleet's board did not answer ({type(exc).__name__})"
            )
        replicas = [mine, *(r for r in others if r.replica != mine.replica)]
        replicas.sort(key=lambda r: (r.node, r.replica))
        return Response(merge(replicas, notes), media_type=CONTENT_TYPE_LATEST)


# the deployment: the replica behind Serve's ingress, its app built in the replica
Verifier: Deployment = serve.deployment(name=DEPLOYMENT_NAME)(serve.ingress()(VerifierReplica))


def build(args: FleetArgs) -> Application:
    """The fleet's Serve application: `Verifier` with `args`' replicas and session cap."""
    return Verifier.options(**args.deployment_options()).bind(args.replica_overrides(), args.direct_options())


def build_app(args: dict[str, Any]) -> Application:
    """Serve's application builder: `args` are the Serve config's (`model`, `weights`,
    `replicas_min`, `replicas_max`, `max_sessions_per_replica`, `max_queued_requests`, `direct`,
    `direct_port`, `direct_host`, `direct_ssl_certfile`, `direct_ssl_keyfile`, all optional;
    `FleetArgs`)."""
    return build(FleetArgs.from_dict(args))
