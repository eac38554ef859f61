"""What every replica of the fleet runs: `{"replicas": [{"node", "pid", "sessions", "queue",
"state", "node_id", "replica", "address"}]}` (`cloud-verifier fleet status`).

Serve knows each replica's node, process and state; the replicas' sessions and queue are the
verifier's own. Each replica reports those every second to the board, a small named Ray actor
(`Board`, in Serve's namespace, living as long as the cluster), and `fleet_status` joins both by
replica id. A replica that has not reported yet (still loading) shows `null` there. The board also
keeps each replica's last metrics exposition, which the fleet's `/metrics` merges (`metrics.py`).

`ReplicaStats` and `status_rows` need no Ray; `board` and `fleet_status` import it when called.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Any, NotRequired, TypedDict

from cloud_verifier.app_state import AppState
from cloud_verifier.fleet.config import APP_NAME, DEPLOYMENT_NAME
from cloud_verifier.fleet.metrics import ReplicaMetrics, bound

BOARD_NAME = "cloud-verifier-fleet-board"
NAMESPACE = "serve"
# a report older than this (a replica gone without a word) is not shown
STALE_S = 30.0


class ReplicaStats(TypedDict):
    """What a replica reports: its open sessions (welcomed or in handshake), the generations its
    engine has waiting (for a step, or for room in the KV pool) and the slots its admission has
    given out (welcomed sessions and HTTP generations)."""

    sessions: int
    queue: int
    generations: NotRequired[int]
    direct: NotRequired[str]  # its own address, where it offers one (`direct.py`)


class ReplicaRow(TypedDict):
    """One replica of `fleet status`: its node (Serve's node IP), process id, sessions and queue
    (None until it reports), Serve's state (STARTING, RUNNING, STOPPING, ...), its node's Ray id
    (nodes of one machine share an IP), Serve's replica id, its own address (None: none, or
    not reported yet) and its admission's slots in use (sessions and HTTP generations; None until
    it reports)."""

    node: str | None
    pid: int | None
    sessions: int | None
    queue: int | None
    state: str
    node_id: str | None
    replica: str | None
    address: str | None
    generations: int | None


def replica_stats(state: AppState | None) -> ReplicaStats:
    """A replica's stats from its app's state (none yet: zeros)."""
    if state is None:
        return {"sessions": 0, "queue": 0}
    engine = state.engine
    queue = engine.waiting + engine.queued if engine is not None else 0
    stats: ReplicaStats = {"sessions": len(state.sessions), "queue": queue}
    admission = getattr(state, "admission", None)
    if admission is not None:
        stats["generations"] = admission.in_use
    direct = getattr(state, "direct", None)
    if direct:
        stats["direct"] = direct
    return stats


def status_rows(
    details: Mapping[str, Any], reports: Mapping[str, tuple[float, ReplicaStats]], now: float
) -> list[ReplicaRow]:
    """The replicas of the fleet's deployment in Serve's details (`serve status`'s document:
    applications -> deployments -> replicas), with their reports (replica id: (time, stats));
    sorted by node and pid."""
    app = details.get("applications", {}).get(APP_NAME)
    if not app:
        return []
    deployment = app.get("deployments", {}).get(DEPLOYMENT_NAME, {})
    rows: list[ReplicaRow] = []
    for r in deployment.get("replicas", ()):
        report = reports.get(r.get("replica_id", ""))
        stats = report[1] if report is not None and now - report[0] <= STALE_S else None
        state = r.get("state", "UNKNOWN")
        rows.append(
            {
                "node": r.get("node_ip"),
                "pid": r.get("pid"),
                "sessions": stats["sessions"] if stats else None,
                "queue": stats["queue"] if stats else None,
                "state": str(getattr(state, "value", state)),  # an enum in Serve's own details
                "node_id": r.get("node_id"),
                "replica": r.get("replica_id"),
                "address": stats.get("direct") if stats else None,
                "generations": stats.get("generations") if stats else None,
            }
        )
    rows.sort(key=lambda row: (row["node"] or "", row["pid"] or 0))
    return rows


def format_rows(rows: Iterable[ReplicaRow]) -> str:
    """A table of the replicas, one a line."""
    lines = [f"{'node':<16} {'pid':>8} {'sessions':>8} {'queue':>6}  {'state':<9} address"]
    for r in rows:
        cells = ["-" if r[k] is None else str(r[k]) for k in ("node", "pid", "sessions", "queue", "address")]
        lines.append(f"{cells[0]:<16} {cells[1]:>8} {cells[2]:>8} {cells[3]:>6}  {r['state']:<9} {cells[4]}")
    return "\n".join(lines)


class _Board:
    """The replicas' last reports (stats, and metrics of at most metrics.MAX_BYTES), by replica id;
    those older than STALE_S are dropped when read."""

    def __init__(self) -> None:
        self.reports: dict[str, tuple[float, ReplicaStats]] = {}
        self.expositions: dict[str, tuple[float, ReplicaMetrics]] = {}

    def report(self, replica: str, stats: ReplicaStats) -> None:
        self.reports[replica] = (time.time(), stats)

    def report_metrics(self, metrics: ReplicaMetrics) -> None:
        self.expositions[metrics.replica] = (time.time(), bound(metrics))

    def snapshot(self) -> dict[str, tuple[float, ReplicaStats]]:
        now = time.time()
        self.reports = {k: v for k, v in self.reports.items() if now - v[0] <= STALE_S}
        return dict(self.reports)

    def metrics(self) -> list[ReplicaMetrics]:
        now = time.time()
        self.expositions = {k: v for k, v in self.expositions.items() if now - v[0] <= STALE_S}
        return [m for _, m in self.expositions.values()]


def board() -> Any:
    """The fleet's board (made on first use; connected to Ray already)."""
    import ray

    actor = ray.remote(num_cpus=0, max_restarts=-1)(_Board)
    return actor.options(
        name=BOARD_NAME, namespace=NAMESPACE, lifetime="detached", get_if_exists=True
    ).remote()


def fleet_status() -> list[ReplicaRow]:
    """The fleet's replicas, from the Ray cluster this process is connected to."""
    import ray
    from ray.serve.context import _get_global_client

    # Serve's details: what `serve status` and the dashboard's /api/serve/applications/ show
    client = _get_global_client()
    if client is None:
        raise RuntimeError("Serve is not running on this Ray cluster")
    details = client.get_serve_details()
    reports: dict[str, tuple[float, ReplicaStats]] = ray.get(board().snapshot.remote(), timeout=30)
    return status_rows(details, reports, time.time())
