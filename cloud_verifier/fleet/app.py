"""The verifier as a Ray Serve deployment: `Verifier` replicas, each today's engine and ASGI app
(`cloud_verifier.server.create_app`) behind Serve's proxy, and `build_app`, the application
builder a Serve config names (`import_path: cloud_verifier.fleet.app:build_app`).

A replica builds its app in the replica process (`__serve_build_asgi_app__`, Serve's late-bound
ingress), from its own `ServerConfig` (`config.replica_config`), and is ready only once its target
is loaded and its engine runs: the app's lifespan waits for the load, so Serve routes no session to
a replica still loading, and a replica whose load fails never starts (Serve retries it). Its health
check fails once its engine stops or stalls. Every second it reports its sessions and queue to the
fleet's board (`status.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator
from typing import Any

import ray
from fastapi import FastAPI
from ray import serve
from ray.serve import Application, Deployment

from cloud_verifier.app_state import AppState
from cloud_verifier.fleet.config import DEPLOYMENT_NAME, FleetArgs, replica_config
from cloud_verifier.fleet.status import ReplicaStats, board, replica_stats

log = logging.getLogger("cloud_verifier.fleet")

REPORT_EVERY_S = 1.0  # how often a replica tells the board its sessions and queue


class VerifierReplica:
    """One replica: the verifier service of `cloud-verifier serve` on this replica's ServerConfig
    (its CLOUD_VERIFIER_<FIELD> variables, then `overrides`)."""

    def __init__(self, overrides: dict[str, Any]) -> None:
        # sleeping OpenMP waiters, as `cloud-verifier serve` sets them (before torch starts its pool)
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        self.config = replica_config(overrides)
        self.state: AppState | None = None

    def __serve_build_asgi_app__(self) -> FastAPI:
        from cloud_verifier.server import create_app

        app = create_app(self.config)
        state: AppState = app.state.verifier
        self.state = state
        serving = app.router.lifespan_context

        @contextlib.asynccontextmanager
        async def lifespan(app: FastAPI) -> AsyncIterator[None]:
            async with serving(app):
                await _loaded(state)
                reporter = asyncio.create_task(_report(state))
                try:
                    yield
                finally:
                    reporter.cancel()

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


async def _report(state: AppState) -> None:
    """Tell the fleet's board this replica's stats every REPORT_EVERY_S, until cancelled."""
    replica = serve.get_replica_context().replica_id.unique_id
    the_board = await asyncio.to_thread(board)  # (a lookup in Ray's control store)
    while True:
        try:
            await the_board.report.remote(replica, replica_stats(state))
        except ray.exceptions.RayError as exc:  # the board restarted or is gone: look it up again
            log.warning("cannot report to the fleet's board: %s", exc)
            the_board = await asyncio.to_thread(board)
        await asyncio.sleep(REPORT_EVERY_S)


# the deployment: the replica behind Serve's ingress, its app built in the replica
Verifier: Deployment = serve.deployment(name=DEPLOYMENT_NAME)(serve.ingress()(VerifierReplica))


def build(args: FleetArgs) -> Application:
    """The fleet's Serve application: `Verifier` with `args`' replicas and session cap."""
    return Verifier.options(**args.deployment_options()).bind(args.replica_overrides())


def build_app(args: dict[str, Any]) -> Application:
    """Serve's application builder: `args` are the Serve config's (`model`, `weights`,
    `replicas_min`, `replicas_max`, `max_sessions_per_replica`, all optional; `FleetArgs`)."""
    return build(FleetArgs.from_dict(args))
