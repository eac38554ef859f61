"""A fleet replica's app without a Ray cluster: its `/metrics` is the fleet's (this replica's metrics
and the others' from the board, labelled by replica and node), and only this replica's, with a
comment, when the board does not answer."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

pytest.importorskip("ray")

from cloud_verifier.fleet import app as fleet_app
from cloud_verifier.fleet.metrics import ReplicaMetrics


class _Method:
    def __init__(self, result: Any) -> None:
        self.result = result

    async def remote(self, *args: Any) -> Any:
        return self.result


class _Board:
    """The board's handle as the replica calls it: `metrics.remote()` answers `others`."""

    def __init__(self, others: list[ReplicaMetrics]) -> None:
        self.metrics = _Method(others)


def _replica(monkeypatch: pytest.MonkeyPatch, the_board: object) -> TestClient:
    """A replica's app (its target not loaded: no lifespan) as replica r-1 on 10.0.0.1."""
    context = SimpleNamespace(replica_id=SimpleNamespace(unique_id="r-1"))
    monkeypatch.setattr("ray.serve.get_replica_context", lambda: context)
    monkeypatch.setattr("ray.util.get_node_ip_address", lambda: "10.0.0.1")
    monkeypatch.setattr(fleet_app, "board", lambda: the_board)
    replica = fleet_app.VerifierReplica({"model": "tiny", "measure_cost": False})
    app = replica.__serve_build_asgi_app__()
    routes = [r for r in app.router.routes if isinstance(r, APIRoute) and r.path == "/metrics"]
    assert len(routes) == 1  # the fleet's replaced the replica's own
    return TestClient(app)


def _samples(text: str, name: str) -> dict[str, float]:
    (family,) = [f for f in text_string_to_metric_families(text) if f.name == name]
    return {f"{s.labels['replica']}@{s.labels['node']}": s.value for s in family.samples}


def test_the_replicas_metrics_are_the_fleets(monkeypatch: pytest.MonkeyPatch) -> None:
    other = ReplicaMetrics("r-2", "10.0.0.2", "# TYPE specdec_sessions gauge\nspecdec_sessions 3\n")
    stale_self = ReplicaMetrics("r-1", "10.0.0.1", "# TYPE specdec_sessions gauge\nspecdec_sessions 99\n")
    client = _replica(monkeypatch, _Board([stale_self, other]))
    response = client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain; version=")
    # this replica's rendered now (no session: 0), not its last report; the other's as reported
    assert _samples(response.text, "specdec_sessions") == {"r-1@10.0.0.1": 0.0, "r-2@10.0.0.2": 3.0}
    assert 'specdec_kv_blocks_total{node="10.0.0.1",replica="r-1"} 0.0' in response.text


def test_without_the_board_a_replica_shows_its_own_metrics(monkeypatch: pytest.MonkeyPatch) -> None:
    client = _replica(monkeypatch, object())  # a handle without `metrics`: a board of another release
    response = client.get("/metrics")
    assert response.status_code == 200
    assert _samples(response.text, "specdec_sessions") == {"r-1@10.0.0.1": 0.0}
    assert response.text.endswith(
        "# this replica's metrics alone: the fleet's board did not answer (AttributeError)\n"
    )
