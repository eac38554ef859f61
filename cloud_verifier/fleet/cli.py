"""`cloud-verifier fleet`: replicas of the verifier on Ray Serve behind one address, and
`cloud-verifier fleet status`: what each replica runs.

`fleet` starts a local Ray cluster (or joins one: `--address`), starts Serve's proxy on
`--host`/`--port` and deploys `replicas` of the verifier (`app.py`), each with `cloud-verifier
serve`'s settings: the flags given here that differ from their defaults, on top of the replica's
own CLOUD_VERIFIER_<FIELD> variables. `--max-sessions` is per replica (a replica refuses a session
past it with 1013, as `serve` does); `--max-queued` is what each Serve proxy holds while every
replica is full (`config.py`). With `--ssl-certfile`/`--ssl-keyfile`, Serve's proxy serves wss:// and
https://, and each replica's own address (`--direct`) serves wss:// with the same certificate, which
must then also name `--direct-host` (or the nodes' IPs). On a local cluster it serves until SIGINT /
SIGTERM; on a joined one the application stays deployed and the command returns.

Exit status as `serve`'s: 0 after serving (or deploying), 1 when the fleet does not start or its
status cannot be read, 2 for a usage error. This module imports Ray only when a command runs.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from cloud_verifier.fleet.config import MAX_QUEUED, NOT_PER_REPLICA, FleetArgs, local_cluster_env
from cloud_verifier.server_config import ServerConfig, field_type, openmp_waiting
from shared.cli_args import integer, seconds
from shared.config_cli import add_config_flags, config_values

# the flags FleetArgs takes by name (the others go to the replicas' ServerConfig as overrides)
_FLEET_FIELDS = {"model": "model", "weights": "weights", "max_sessions": "max_sessions_per_replica"}


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`fleet` and `fleet status` on the `cloud-verifier` command line."""
    p = sub.add_parser(
        "fleet",
        help="run replicas of the verifier on Ray Serve behind one address (the fleet extra)",
        description="Start a Ray cluster (or join one: --address) and deploy the verifier on Ray "
        "Serve: WebSocket /v1/session and the OpenAI API on --host/--port, spread over the replicas. "
        "Every serve flag applies to each replica (--max-sessions: per replica).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--address", default=None, help="join this Ray cluster (default: start a local one)")
    count = integer(1, 4096)
    p.add_argument("--replicas", type=count, default=None, help="a fixed number of replicas (default 1)")
    p.add_argument("--min-replicas", type=count, default=None, help="autoscale from this many replicas")
    p.add_argument("--max-replicas", type=count, default=None, help="autoscale up to this many replicas")
    p.add_argument(
        "--max-queued",
        type=integer(1, 1 << 20),
        default=MAX_QUEUED,
        help="requests each Serve proxy holds while every replica is full; more are refused at once "
        "(HTTP 503; a WebSocket upgrade gets 500)",
    )
    p.add_argument(
        "--gpus-per-replica",
        type=integer(1, 64),
        default=None,
        help="GPUs each replica holds: 1, or N > 1 for tensor parallelism across N GPUs inside the "
        "replica (as serve's --tensor-parallel N; sets --device cuda)",
    )
    delay = seconds(86400.0, zero=True)
    p.add_argument(
        "--upscale-delay",
        type=delay,
        default=FleetArgs.upscale_delay_s,
        help="autoscaling: seconds the sessions per replica stay above 3/4 of --max-sessions before "
        "a replica is added",
    )
    p.add_argument(
        "--downscale-delay",
        type=delay,
        default=FleetArgs.downscale_delay_s,
        help="autoscaling: seconds they stay below it before a replica is stopped (a stopping replica "
        "takes no new session and its open ones get --drain-timeout)",
    )
    p.add_argument(
        "--direct",
        action=argparse.BooleanOptionalAction,
        default=FleetArgs.direct,
        help="each replica also listens on an address of its own and offers it to clients, which "
        "move their sessions there past Serve's proxy (the proxy still routes and counts them); a "
        "client that cannot reach it stays on the proxy after at most 3 s; --no-direct where clients "
        "never can (outside a Kubernetes cluster)",
    )
    p.add_argument(
        "--direct-port",
        type=integer(0, 65535),
        default=FleetArgs.direct_port,
        help="with --direct: the port each replica listens on, or the next free one above it "
        "(0: any free port)",
    )
    p.add_argument(
        "--direct-host",
        default=FleetArgs.direct_host,
        help="with --direct: the host name or IP clients reach the replicas by (default: each "
        "replica's node IP)",
    )
    add_config_flags(p, ServerConfig, defaults=ServerConfig.from_env(), parse=field_type)
    commands = p.add_subparsers(dest="fleet_command", help="`status`: what each replica runs")
    s = commands.add_parser(
        "status",
        help="the replicas of a running fleet: node, pid, sessions, queue, state",
        description="Print the fleet's replicas: {'replicas': [{node, pid, sessions, queue, state}]}.",
    )
    s.add_argument(
        "--address",
        default=argparse.SUPPRESS,
        help="the Ray cluster (default: the one this machine runs, RAY_ADDRESS)",
    )
    s.add_argument("--json", action="store_true", help="print JSON instead of a table")


def fleet_args(args: argparse.Namespace) -> FleetArgs | str:
    """The fleet `args` asks for, or what is wrong with the flags (a usage error)."""
    if args.replicas is not None and (args.min_replicas is not None or args.max_replicas is not None):
        return "--replicas is a fixed count: give it, or --min-replicas / --max-replicas, not both"
    lo = args.replicas or args.min_replicas or 1
    hi = args.replicas or args.max_replicas or max(lo, 1)
    if lo > hi:
        return f"--min-replicas {lo} > --max-replicas {hi}"
    values = config_values(ServerConfig, args)
    cert, key = values.get("ssl_certfile") or None, values.get("ssl_keyfile") or None
    if (cert is None) != (key is None):
        return "--ssl-certfile and --ssl-keyfile go together"
    gpus = args.gpus_per_replica
    if gpus:
        tp = values.get("tensor_parallel", 1)
        if tp > 1 and tp != gpus:
            return f"--gpus-per-replica {gpus} runs {gpus} tensor-parallel ranks: drop --tensor-parallel {tp}"
        if values.get("device", "auto") not in ("auto", "cuda"):
            return f"--gpus-per-replica puts each replica on GPUs: leave --device {values['device']} out"
        values["device"] = "cuda"
        values["tensor_parallel"] = gpus
    defaults = ServerConfig.from_env()
    overrides = {
        name: value
        for name, value in values.items()
        if name not in _FLEET_FIELDS and name not in NOT_PER_REPLICA and value != getattr(defaults, name)
    }
    named = {_FLEET_FIELDS[k]: v for k, v in values.items() if k in _FLEET_FIELDS}
    try:
        fleet = FleetArgs(
            replicas_min=lo,
            replicas_max=hi,
            max_queued_requests=args.max_queued,
            upscale_delay_s=args.upscale_delay,
            downscale_delay_s=args.downscale_delay,
            direct=args.direct,
            direct_port=args.direct_port,
            direct_host=args.direct_host,
            direct_ssl_certfile=cert,
            direct_ssl_keyfile=key,
            overrides=overrides,
            **named,
        )
        replace(defaults, **fleet.replica_overrides())  # the replicas' config holds together
    except ValueError as exc:
        return str(exc)
    return fleet


def run(args: argparse.Namespace, file_error: Callable[[ServerConfig], str | None]) -> int:
    """`fleet` or `fleet status`: the exit status. `file_error`: what is wrong with a file a
    config names (`serve`'s check), or None."""
    if args.fleet_command == "status":
        return _status(args)
    fleet = fleet_args(args)
    if isinstance(fleet, str):
        print(f"cloud-verifier fleet: {fleet}", file=sys.stderr)
        return 2
    tls: dict[str, Any] = {"ssl_certfile": fleet.direct_ssl_certfile, "ssl_keyfile": fleet.direct_ssl_keyfile}
    if args.address is None:  # local replicas read the files here
        why = file_error(replace(ServerConfig.from_env(), **fleet.replica_overrides(), **tls))
        if why:
            print(f"cloud-verifier fleet: {why}", file=sys.stderr)
            return 2
    return _serve(fleet, args.address, {"host": args.host, "port": args.port, **tls})


def _serve(fleet: FleetArgs, address: str | None, http: dict[str, Any]) -> int:
    """Serve the fleet: Serve's proxy on `http` (host, port and TLS files, Serve's HTTPOptions)."""
    import ray
    from ray import serve

    from cloud_verifier.fleet.app import build
    from cloud_verifier.fleet.config import APP_NAME

    stop = threading.Event()
    if address is None:
        # a local cluster's workers start with this process's environment: the replicas' OpenMP
        # threads wait as `serve`'s do (their libgomp reads it when torch loads, before any code
        # of the replica runs)
        threads = int(fleet.replica_overrides().get("threads") or ServerConfig.from_env().threads)
        os.environ.update(openmp_waiting(threads or os.cpu_count() or 1, os.environ))
        os.environ.update(local_cluster_env(os.environ))  # a lighter control plane
    ray.init(address=address)
    try:
        serve.start(http_options={k: v for k, v in http.items() if v is not None})
        try:
            serve.run(build(fleet), name=APP_NAME, route_prefix="/")
        except RuntimeError as exc:  # a replica failed to start (its log says why)
            print(f"cloud-verifier fleet: the fleet did not start: {exc}", file=sys.stderr)
            return 1
        n = fleet.replicas_min if fleet.replicas_min == fleet.replicas_max else "autoscaled"
        own = ", each replica offering its own address" if fleet.direct else ""
        scheme = "wss" if http.get("ssl_certfile") else "ws"
        where = f"{scheme}://{http['host']}:{http['port']}/v1/session"
        print(
            f"cloud-verifier fleet: {n} replicas of {fleet.model} at {where}{own}",
            file=sys.stderr,
        )
        if address is not None:  # a joined cluster keeps the application
            return 0
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        stop.wait()
        shutdown: Callable[[], None] = serve.shutdown  # (untyped in Ray)
        shutdown()  # each replica ends its sessions (Serve's graceful shutdown)
        return 0
    finally:
        ray.shutdown()


def _status(args: argparse.Namespace) -> int:
    import ray

    from cloud_verifier.fleet.status import fleet_status, format_rows

    address = getattr(args, "address", None) or "auto"
    try:
        ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False)
        rows = fleet_status()
    except Exception as exc:  # no cluster, no Serve, no fleet: one line
        print(f"cloud-verifier fleet status: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    finally:
        ray.shutdown()
    out: dict[str, Any] = {"replicas": rows}
    print(json.dumps(out) if args.json else format_rows(rows))
    return 0
