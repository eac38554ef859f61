"""`cloud-verifier fleet`'s command line, parsed without starting Ray."""

from __future__ import annotations

import argparse

import pytest

from cloud_verifier.cli import build_parser, main
from cloud_verifier.fleet.cli import fleet_args
from cloud_verifier.fleet.config import MAX_QUEUED, FleetArgs


def _parse(argv: list[str]) -> argparse.Namespace:
    return build_parser().parse_args(["fleet", *argv])


def test_serve_flags_apply_to_every_replica() -> None:
    args = _parse(
        ["--replicas", "2", "--model", "tiny", "--max-sessions", "4", "--threads", "1", "--port", "9"]
    )
    fleet = fleet_args(args)
    assert isinstance(fleet, FleetArgs)
    assert (fleet.replicas_min, fleet.replicas_max, fleet.max_sessions_per_replica) == (2, 2, 4)
    assert fleet.model == "tiny"
    assert fleet.overrides == {"threads": 1}  # --port is Serve's proxy's, defaults stay the replicas'
    assert args.port == 9


def test_max_queued_is_each_proxys_queue() -> None:
    fleet = fleet_args(_parse(["--max-queued", "3", "--max-sessions", "2"]))
    assert isinstance(fleet, FleetArgs)
    assert (fleet.max_queued_requests, fleet.max_sessions_per_replica) == (3, 2)
    assert fleet.overrides == {}  # the fleet's, not a replica's
    fleet = fleet_args(_parse([]))
    assert isinstance(fleet, FleetArgs) and fleet.max_queued_requests == MAX_QUEUED
    with pytest.raises(SystemExit):
        _parse(["--max-queued", "0"])


def test_autoscaling_flags() -> None:
    fleet = fleet_args(_parse(["--min-replicas", "2", "--max-replicas", "5"]))
    assert isinstance(fleet, FleetArgs)
    assert (fleet.replicas_min, fleet.replicas_max) == (2, 5)
    fleet = fleet_args(_parse(["--max-replicas", "3"]))
    assert isinstance(fleet, FleetArgs)
    assert (fleet.replicas_min, fleet.replicas_max) == (1, 3)
    fleet = fleet_args(_parse([]))
    assert isinstance(fleet, FleetArgs)
    assert (fleet.replicas_min, fleet.replicas_max) == (1, 1)
    assert (fleet.upscale_delay_s, fleet.downscale_delay_s) == (30.0, 600.0)
    fleet = fleet_args(_parse(["--max-replicas", "3", "--upscale-delay", "2", "--downscale-delay", "0"]))
    assert isinstance(fleet, FleetArgs)
    assert (fleet.upscale_delay_s, fleet.downscale_delay_s) == (2.0, 0.0)
    with pytest.raises(SystemExit):
        _parse(["--downscale-delay", "-1"])


def test_direct_flags_give_each_replica_its_own_address() -> None:
    fleet = fleet_args(_parse(["--no-direct"]))
    assert isinstance(fleet, FleetArgs) and fleet.direct_options() is None
    fleet = fleet_args(_parse([]))
    assert isinstance(fleet, FleetArgs) and fleet.direct_options() is not None  # the default
    fleet = fleet_args(_parse(["--direct-port", "9100", "--direct-host", "edge.example"]))
    assert isinstance(fleet, FleetArgs)
    options = fleet.direct_options()
    assert options is not None and (options.port, options.host, options.bind_host) == (
        9100,
        "edge.example",
        "0.0.0.0",
    )
    with pytest.raises(SystemExit):
        _parse(["--direct-port", "65536"])


def test_tensor_parallel_inside_each_replica() -> None:
    """--tensor-parallel N runs N ranks inside each replica (its --threads split among them);
    --gpus-per-replica N does so on N GPUs, which the replica holds."""
    fleet = fleet_args(_parse(["--tensor-parallel", "2", "--threads", "2"]))
    assert isinstance(fleet, FleetArgs) and fleet.overrides["tensor_parallel"] == 2
    assert fleet.deployment_options()["ray_actor_options"] == {"num_cpus": 2}
    fleet = fleet_args(_parse(["--gpus-per-replica", "2"]))
    assert isinstance(fleet, FleetArgs)
    assert (fleet.overrides["device"], fleet.overrides["tensor_parallel"]) == ("cuda", 2)
    assert fleet.deployment_options()["ray_actor_options"] == {"num_gpus": 2}
    fleet = fleet_args(_parse(["--gpus-per-replica", "1"]))
    assert isinstance(fleet, FleetArgs) and "tensor_parallel" not in fleet.overrides
    assert fleet.deployment_options()["ray_actor_options"] == {"num_gpus": 1}


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--replicas", "2", "--max-replicas", "3"], "not both"),
        (["--min-replicas", "3", "--max-replicas", "2"], "--min-replicas 3 > --max-replicas 2"),
        (["--ssl-certfile", "c.pem"], "--ssl-certfile and --ssl-keyfile go together"),
        (["--gpus-per-replica", "2", "--tensor-parallel", "4"], "drop --tensor-parallel 4"),
        (["--gpus-per-replica", "1", "--device", "cpu"], "--device cpu"),
    ],
)
def test_usage_errors(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    why = fleet_args(_parse(argv))
    assert isinstance(why, str) and message in why
    assert main(["fleet", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("cloud-verifier fleet: ") and message in err and err.count("\n") == 1


def test_a_missing_key_file_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["fleet", "--api-key-file", "/nonexistent/keys"]) == 2
    assert "--api-key-file /nonexistent/keys" in capsys.readouterr().err


def test_tls_serves_the_proxy_and_each_replicas_own_address(capsys: pytest.CaptureFixture[str]) -> None:
    fleet = fleet_args(_parse(["--ssl-certfile", "c.pem", "--ssl-keyfile", "k.pem"]))
    assert isinstance(fleet, FleetArgs) and "ssl_certfile" not in fleet.overrides
    options = fleet.direct_options()
    assert options is not None and options.tls
    assert (options.ssl_certfile, options.ssl_keyfile) == ("c.pem", "k.pem")
    assert not fleet_args(_parse([])).direct_options().tls  # type: ignore[union-attr]
    # a local fleet checks the files before it starts Ray, as serve does
    assert main(["fleet", "--ssl-certfile", "/nonexistent/c.pem", "--ssl-keyfile", "/nonexistent/k.pem"]) == 2
    assert "--ssl-certfile /nonexistent/c.pem" in capsys.readouterr().err


def test_status_flags() -> None:
    args = _parse(["status", "--json", "--address", "10.0.0.1:6379"])
    assert (args.fleet_command, args.json, args.address) == ("status", True, "10.0.0.1:6379")
    args = _parse(["--address", "10.0.0.2:6379", "status"])
    assert (args.fleet_command, args.json, args.address) == ("status", False, "10.0.0.2:6379")


def test_status_without_a_cluster_is_one_line_and_status_1(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("ray")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert main(["fleet", "status", "--json"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.splitlines()[-1].startswith("cloud-verifier fleet status: ")


@pytest.mark.parametrize(
    ("threads", "want"), [("3", {"GOMP_SPINCOUNT": "20000"}), ("1", {"OMP_WAIT_POLICY": "PASSIVE"})]
)
def test_a_local_clusters_replicas_wait_as_serve_does(
    threads: str, want: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before it starts a local cluster (whose workers inherit its environment), the fleet sets
    the OpenMP waiting `serve` would choose for a replica's threads; a set environment is kept."""
    import os

    import ray

    from cloud_verifier.fleet import cli

    class Started(Exception):
        pass

    def init(**kwargs: object) -> None:
        raise Started(dict(os.environ))

    monkeypatch.setattr(ray, "init", init)
    # the process's environment as a copy that the test throws away (the fleet writes to it)
    clean = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    monkeypatch.setattr(os, "environ", clean)
    fleet = fleet_args(build_parser().parse_args(["fleet", "--model", "tiny", "--threads", threads]))
    assert isinstance(fleet, FleetArgs)
    with pytest.raises(Started) as seen:
        cli._serve(fleet, None, {"host": "127.0.0.1", "port": 0})
    env = seen.value.args[0]
    assert {k: env[k] for k in want} == want and not (set(env) & {"OMP_WAIT_POLICY", "GOMP_SPINCOUNT"}) - set(
        want
    )
    chosen = {k: v for k, v in clean.items() if k not in want} | {"OMP_WAIT_POLICY": "ACTIVE"}
    monkeypatch.setattr(os, "environ", chosen)  # the user's choice stays
    with pytest.raises(Started) as seen:
        cli._serve(fleet, None, {"host": "127.0.0.1", "port": 0})
    assert seen.value.args[0]["OMP_WAIT_POLICY"] == "ACTIVE" and "GOMP_SPINCOUNT" not in seen.value.args[0]


def test_a_local_cluster_starts_with_a_lighter_control_plane(monkeypatch: pytest.MonkeyPatch) -> None:
    """Serve's controller loop and Ray's metrics collection as LOCAL_CLUSTER_ENV sets them, for
    the cluster `fleet` starts (its processes inherit the environment); a user's setting stays, and
    a joined cluster keeps its own."""
    import os

    import ray

    from cloud_verifier.fleet import cli
    from cloud_verifier.fleet.config import LOCAL_CLUSTER_ENV

    class Started(Exception):
        pass

    def init(**kwargs: object) -> None:
        raise Started(dict(os.environ))

    monkeypatch.setattr(ray, "init", init)
    fleet = fleet_args(_parse(["--model", "tiny"]))
    assert isinstance(fleet, FleetArgs)
    bare = {k: v for k, v in os.environ.items() if k not in LOCAL_CLUSTER_ENV}
    for environ, address, want in (
        (bare, None, LOCAL_CLUSTER_ENV),
        (
            bare | {"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.2"},
            None,
            {**LOCAL_CLUSTER_ENV, "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.2"},
        ),
        (bare, "10.0.0.1:6379", {}),
    ):
        monkeypatch.setattr(os, "environ", dict(environ))
        with pytest.raises(Started) as seen:
            cli._serve(fleet, address, {"host": "127.0.0.1", "port": 0})
        assert {k: v for k, v in seen.value.args[0].items() if k in LOCAL_CLUSTER_ENV} == want
