"""The fleet's settings without Ray: build_app's arguments to Serve's deployment options and the
replicas' ServerConfig, the RayService's arguments, and the status document from fake replicas."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml

from cloud_verifier.fleet.config import APP_NAME, DEPLOYMENT_NAME, FleetArgs, replica_config
from cloud_verifier.fleet.status import ReplicaStats, format_rows, replica_stats, status_rows
from cloud_verifier.server_config import ServerConfig

RAYSERVICE = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes" / "rayservice.yaml"


def test_a_fixed_count_of_replicas_with_the_session_cap() -> None:
    fleet = FleetArgs(model="tiny", replicas_min=2, replicas_max=2, max_sessions_per_replica=8)
    options = fleet.deployment_options()
    # the fleet's router (resumes to their KV holder), reading each replica's load every second
    assert options.pop("request_router_config") == {
        "request_router_class": "cloud_verifier.fleet.router.SessionRouter",
        "request_routing_stats_period_s": 1.0,
    }
    assert options == {
        "name": DEPLOYMENT_NAME,
        "max_ongoing_requests": 8 + 64 + 64,  # the sessions, handshakes and HTTP requests waiting
        "max_queued_requests": 16,
        "backpressure_config": {"retry_after_s": 1.0},
        "num_replicas": 2,
    }
    assert fleet.replica_overrides() == {"model": "tiny", "weights": "auto", "max_sessions": 8}


def test_serve_hands_a_replica_more_than_its_session_cap_and_queues_little() -> None:
    """Serve's cap is what one verifier takes (its sessions, handshakes and HTTP requests waiting),
    so a session past the session cap reaches a replica, which refuses it with 1013; what finds
    every replica at that cap waits in a proxy, at most max_queued_requests."""
    fleet = FleetArgs(max_sessions_per_replica=4, overrides={"max_handshakes": 2, "max_waiting": 0})
    assert fleet.serve_cap() == 6
    options = fleet.deployment_options()
    assert (options["max_ongoing_requests"], options["max_queued_requests"]) == (6, 16)
    assert options["backpressure_config"] == {"retry_after_s": 1.0}  # the proxy's 503: Retry-After
    assert (
        FleetArgs(max_sessions_per_replica=4).serve_cap()
        == 4 + ServerConfig.max_handshakes + ServerConfig.max_waiting
    )
    queued = FleetArgs.from_dict({"max_queued_requests": 2})
    assert queued.deployment_options()["max_queued_requests"] == 2
    # the autoscaler still counts by the session cap
    scaled = FleetArgs(replicas_max=2, max_sessions_per_replica=8).deployment_options()
    assert scaled["autoscaling_config"]["target_ongoing_requests"] == 6


def test_autoscaling_between_min_and_max() -> None:
    options = FleetArgs(replicas_min=1, replicas_max=4, max_sessions_per_replica=16).deployment_options()
    assert "num_replicas" not in options
    assert options["autoscaling_config"] == {
        "min_replicas": 1,
        "max_replicas": 4,
        "target_ongoing_requests": 12,
        "upscale_delay_s": 30.0,  # Serve's defaults
        "downscale_delay_s": 600.0,
    }
    quick = FleetArgs(replicas_max=2, upscale_delay_s=2, downscale_delay_s=15.5).deployment_options()
    assert quick["autoscaling_config"]["upscale_delay_s"] == 2.0
    assert quick["autoscaling_config"]["downscale_delay_s"] == 15.5
    for bad in (-1.0, float("nan"), True, 1e9):
        with pytest.raises(ValueError, match="downscale_delay_s"):
            FleetArgs(replicas_max=2, downscale_delay_s=bad)
    assert (
        FleetArgs(replicas_max=3, max_sessions_per_replica=1).deployment_options()["autoscaling_config"][
            "target_ongoing_requests"
        ]
        == 1
    )


def test_threads_device_and_drain_become_serve_options() -> None:
    overrides = {"threads": 4, "device": "cuda", "drain_timeout_s": 45.0}
    options = FleetArgs(overrides=overrides).deployment_options()
    assert options["ray_actor_options"] == {"num_cpus": 4, "num_gpus": 1}
    assert options["graceful_shutdown_timeout_s"] == 45.0


def test_the_rayservice_arguments_build_its_deployment() -> None:
    """rayservice.yaml's `args` are build_app's, and make the deployment it declares beside them."""
    doc = next(d for d in yaml.safe_load_all(RAYSERVICE.read_text()) if d and d["kind"] == "RayService")
    (app,) = yaml.safe_load(doc["spec"]["serveConfigV2"])["applications"]
    assert app["name"] == APP_NAME
    options = FleetArgs.from_dict(app["args"]).deployment_options()
    (deployment,) = app["deployments"]
    assert deployment["name"] == options["name"]
    assert deployment["max_ongoing_requests"] == options["max_ongoing_requests"]
    assert deployment["autoscaling_config"]["min_replicas"] == options["autoscaling_config"]["min_replicas"]
    assert deployment["autoscaling_config"]["max_replicas"] == options["autoscaling_config"]["max_replicas"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"replicas": 2}, "unknown fleet arguments ['replicas']"),
        ({"replicas_min": 3, "replicas_max": 2}, "replicas_min 3 > replicas_max 2"),
        ({"replicas_min": 0}, "replicas_min: expected a whole number >= 1"),
        ({"max_sessions_per_replica": True}, "max_sessions_per_replica: expected a whole number"),
        ({"max_queued_requests": 0}, "max_queued_requests: expected a whole number >= 1"),
        ({"weights": "int4"}, "weights 'int4' is not one of"),
        ({"model": ""}, "the model"),
        ({"overrides": {"port": 9000}}, "port is the fleet's"),
        ({"overrides": {"colour": "red"}}, "'colour' is no ServerConfig field"),
        ({"direct": "yes"}, "direct: expected true or false"),
        ({"direct": True, "direct_port": 70000}, "direct_port: expected a port number in [0, 65535]"),
        ({"direct": True, "direct_host": "ws://x"}, "direct host: expected a host name"),
    ],
)
def test_bad_arguments_name_what_is_wrong(args: dict[str, Any], message: str) -> None:
    with pytest.raises(Exception, match=None) as info:
        FleetArgs.from_dict(args)
    assert message in str(info.value)


def test_a_replica_reads_its_environment_then_the_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CLOUD_VERIFIER_THREADS", "3")
    monkeypatch.setenv("CLOUD_VERIFIER_MAX_SESSIONS", "99")
    config = replica_config(FleetArgs(model="tiny", max_sessions_per_replica=5).replica_overrides())
    assert (config.model, config.threads, config.max_sessions) == ("tiny", 3, 5)
    with pytest.raises(ValueError, match="max_sessions"):
        replica_config({"max_sessions": 0})


def test_replica_stats() -> None:
    assert replica_stats(None) == {"sessions": 0, "queue": 0}
    state = SimpleNamespace(
        sessions={object(), object(), object()}, engine=SimpleNamespace(waiting=2, queued=1)
    )
    assert replica_stats(state) == {"sessions": 3, "queue": 3}  # type: ignore[arg-type]
    assert replica_stats(SimpleNamespace(sessions=set(), engine=None)) == {"sessions": 0, "queue": 0}  # type: ignore[arg-type]
    # the admission's slots: welcomed sessions and HTTP generations alike
    serving = SimpleNamespace(sessions={object()}, engine=None, admission=SimpleNamespace(in_use=4))
    assert replica_stats(serving) == {"sessions": 1, "queue": 0, "generations": 4}  # type: ignore[arg-type]


def _details(*replicas: dict[str, Any]) -> dict[str, Any]:
    return {"applications": {APP_NAME: {"deployments": {DEPLOYMENT_NAME: {"replicas": list(replicas)}}}}}


def test_status_rows_join_serve_and_the_reports() -> None:
    details = _details(
        {"replica_id": "b", "node_ip": "10.0.0.2", "pid": 7, "state": "RUNNING", "node_id": "n2"},
        {"replica_id": "a", "node_ip": "10.0.0.1", "pid": 9, "state": "RUNNING", "node_id": "n1"},
        {"replica_id": "c", "node_ip": "10.0.0.1", "pid": 3, "state": "STARTING", "node_id": "n1"},
        {"replica_id": "d", "node_ip": "10.0.0.3", "pid": 4, "state": "RUNNING", "node_id": "n3"},
    )
    stats: ReplicaStats = {"sessions": 4, "queue": 1, "direct": "ws://10.0.0.1:9100/v1/session"}
    idle: ReplicaStats = {"sessions": 0, "queue": 0}
    reports = {"a": (100.0, stats), "b": (99.0, idle), "d": (10.0, stats)}
    rows = status_rows(details, reports, now=101.0)
    own = "ws://10.0.0.1:9100/v1/session"
    assert [(r["node"], r["pid"], r["sessions"], r["queue"], r["state"]) for r in rows] == [
        ("10.0.0.1", 3, None, None, "STARTING"),
        ("10.0.0.1", 9, 4, 1, "RUNNING"),
        ("10.0.0.2", 7, 0, 0, "RUNNING"),
        ("10.0.0.3", 4, None, None, "RUNNING"),  # stale
    ]
    assert [(r["node_id"], r["replica"], r["address"]) for r in rows] == [
        ("n1", "c", None),
        ("n1", "a", own),
        ("n2", "b", None),
        ("n3", "d", None),
    ]
    table = format_rows(rows).splitlines()
    assert table[0].split() == ["node", "pid", "sessions", "queue", "state", "address"]
    assert table[1].split() == ["10.0.0.1", "3", "-", "-", "STARTING", "-"]
    assert table[2].split() == ["10.0.0.1", "9", "4", "1", "RUNNING", own]
    assert status_rows({"applications": {}}, reports, now=0.0) == []


def test_default_fleet_args_are_serves_defaults() -> None:
    fleet = FleetArgs()
    assert (fleet.model, fleet.weights) == (ServerConfig.model, ServerConfig.weights)
    assert fleet.max_sessions_per_replica == ServerConfig.max_sessions
