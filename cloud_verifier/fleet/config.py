"""The fleet's settings: the application's arguments (`FleetArgs`, the keys a Serve config's `args`
and `cloud-verifier fleet` give), the Serve deployment options they make, and each replica's
`ServerConfig`.

Past its session cap a replica answers as `cloud-verifier serve` does: Serve hands it up to
`serve_cap` connections and requests (its sessions, the connections in handshake, the HTTP
requests waiting for a slot), so a session beyond the cap reaches a replica and is refused there
with close 1013 after its hello, and probes and scrapes never wait behind sessions. What finds
every replica at its `serve_cap` waits in Serve's proxy, at most `max_queued_requests` per proxy;
the proxy refuses more at once: HTTP 503 with Retry-After, a WebSocket upgrade HTTP 500 (Serve's
503 is not a message a WebSocket handshake can carry; uvicorn answers its error instead).

A replica reads its settings like `cloud-verifier serve` does: `ServerConfig.from_env()` (the
CLOUD_VERIFIER_<FIELD> variables of the machine it runs on), then the overrides the application
was built with (`FleetArgs.overrides`: model, weights, the session cap and any serve flag given to
`cloud-verifier fleet`). The environment is read in the replica, not where the application is
built: a RayService builds it on the head, whose containers have none of the workers' variables.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from cloud_verifier.server_config import WEIGHTS, ServerConfig, field_type

APP_NAME = "verifier"  # the Serve application (rayservice.yaml's `applications[0].name`)
DEPLOYMENT_NAME = "Verifier"
# autoscaling adds a replica when the replicas average more than this share of their session cap
TARGET_LOAD = 0.75
# requests each Serve proxy holds while every replica is at its serve_cap (or none runs yet)
MAX_QUEUED = 16
# the deployment's request router (router.py), and how often it reads each replica's load
ROUTER = "cloud_verifier.fleet.router.SessionRouter"
ROUTING_STATS_S = 1.0
# a local cluster's control plane, unless the environment sets them: Serve's controller loop every
# 0.5 s (Ray's default: 0.1 s; health checks, autoscaling and restarts act on seconds), and no Ray
# metrics collection (the fleet's /metrics is its own, `metrics.py`). Beside two idle replicas on
# a 2-core machine the cluster's own processes then took 5.0% of a core instead of 7.6%
# (`bench.fleet --parts control_plane`): CPU the replicas get back where they share the cores
LOCAL_CLUSTER_ENV = {"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5", "RAY_enable_metrics_collection": "0"}
# settings a replica never takes from the fleet: Serve's proxy listens, TLS and the port are its
NOT_PER_REPLICA = frozenset({"host", "port", "ssl_certfile", "ssl_keyfile", "resume_tag"})


@dataclass(frozen=True)
class DirectOptions:
    """Where a replica listens on its own: `port` (0: any free port, else the first of PORT_TRIES
    tried), `bind_host` the interface, `host` the name or IP clients reach it by ("" : its Ray
    node's IP); `ssl_certfile` and `ssl_keyfile` (PEM paths on the replica's node, both or
    neither): it serves wss:// with them, and the certificate must name `host` (or the node IPs)."""

    port: int = 0
    bind_host: str = "0.0.0.0"
    host: str = ""
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ValueError(f"direct_port: expected a port number in [0, 65535], got {self.port!r}")
        for name in ("bind_host", "host"):
            value = getattr(self, name)
            if not isinstance(value, str) or len(value) > 253 or any(c in value for c in "/:@ "):
                raise ValueError(f"direct {name}: expected a host name or IPv4 address, got {value!r}")
        for name in ("ssl_certfile", "ssl_keyfile"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not 0 < len(value) <= 4096):
                raise ValueError(f"direct_{name}: expected the path of a PEM file, got {value!r}")
        if (self.ssl_certfile is None) != (self.ssl_keyfile is None):
            raise ValueError("direct_ssl_certfile and direct_ssl_keyfile go together")

    @property
    def tls(self) -> bool:
        """Whether the replica's own address is wss://."""
        return self.ssl_certfile is not None


@dataclass(frozen=True)
class FleetArgs:
    """`build_app`'s arguments. `overrides`: further ServerConfig fields every replica takes
    (field name: value), on top of its CLOUD_VERIFIER_<FIELD> variables."""

    model: str = ServerConfig.model
    weights: str = ServerConfig.weights
    replicas_min: int = 1
    replicas_max: int = 1
    max_sessions_per_replica: int = ServerConfig.max_sessions
    max_queued_requests: int = MAX_QUEUED
    # autoscaling: how long the load must stay above (below) the target before a replica is added
    # (stopped); Serve's defaults
    upscale_delay_s: float = 30.0
    downscale_delay_s: float = 600.0
    # each replica also listens on an address of its own and offers it to clients (`direct.py`):
    # the port (0: any free one), and the host clients reach it by ("": the replica's node IP)
    direct: bool = True
    direct_port: int = 0
    direct_host: str = ""
    # its own address serves wss:// with this certificate and key (PEM paths on each replica's node)
    direct_ssl_certfile: str | None = None
    direct_ssl_keyfile: str | None = None
    overrides: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        field_type("model")(self.model)
        if self.weights not in WEIGHTS:
            raise ValueError(f"weights {self.weights!r} is not one of {', '.join(WEIGHTS)}")
        for name in ("replicas_min", "replicas_max", "max_sessions_per_replica", "max_queued_requests"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a whole number >= 1, got {value!r}")
        for name in ("upscale_delay_s", "downscale_delay_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 86400:
                raise ValueError(f"{name}: expected seconds in [0, 86400], got {value!r}")
        if not isinstance(self.direct, bool):
            raise ValueError(f"direct: expected true or false, got {self.direct!r}")
        self._direct()  # (its errors name the field)
        if self.replicas_min > self.replicas_max:
            raise ValueError(f"replicas_min {self.replicas_min} > replicas_max {self.replicas_max}")
        known = {f.name for f in fields(ServerConfig)}
        for name in self.overrides:
            if name not in known:
                raise ValueError(f"overrides: {name!r} is no ServerConfig field")
            if name in NOT_PER_REPLICA:
                raise ValueError(f"overrides: {name} is the fleet's, not a replica's (Serve's proxy)")

    @classmethod
    def from_dict(cls, args: dict[str, Any]) -> FleetArgs:
        """From a Serve config's `args` (unknown keys are an error naming them)."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(args) - known)
        if unknown:
            raise ValueError(f"unknown fleet arguments {unknown}; expected some of {sorted(known)}")
        return cls(**args)

    def replica_overrides(self) -> dict[str, Any]:
        """The ServerConfig fields a replica sets over its environment's."""
        return {
            **self.overrides,
            "model": self.model,
            "weights": self.weights,
            "max_sessions": self.max_sessions_per_replica,
        }

    def direct_options(self) -> DirectOptions | None:
        """Where each replica listens on its own (None: `direct` is off)."""
        return self._direct() if self.direct else None

    def _direct(self) -> DirectOptions:
        return DirectOptions(
            port=self.direct_port,
            host=self.direct_host,
            ssl_certfile=self.direct_ssl_certfile,
            ssl_keyfile=self.direct_ssl_keyfile,
        )

    def serve_cap(self) -> int:
        """Serve's `max_ongoing_requests` of a replica (one WebSocket is one request for as long as
        it is open): what one verifier takes at once, its session cap, the connections in handshake
        (`max_handshakes`) and the HTTP requests waiting for a slot (`max_waiting`), from the
        overrides or ServerConfig's defaults."""
        handshakes = int(self.overrides.get("max_handshakes", ServerConfig.max_handshakes))
        waiting = int(self.overrides.get("max_waiting", ServerConfig.max_waiting))
        return self.max_sessions_per_replica + handshakes + waiting

    def deployment_options(self) -> dict[str, Any]:
        """Serve's options of the `Verifier` deployment: a replica takes at most `serve_cap`
        connections and requests, each proxy queues at most `max_queued_requests` beyond them
        (module doc), a replica holds the CPUs of its `threads` (a GPU with a `cuda` device); a
        fixed count of replicas, or autoscaling between min and max when they differ (by the
        session cap)."""
        cap = self.max_sessions_per_replica
        options: dict[str, Any] = {
            "name": DEPLOYMENT_NAME,
            "max_ongoing_requests": self.serve_cap(),
            "max_queued_requests": self.max_queued_requests,
            "backpressure_config": {"retry_after_s": 1.0},  # the proxy's 503: Retry-After: 1
            # resumes to the replica holding their KV cache, new sessions to the least loaded
            "request_router_config": {
                "request_router_class": ROUTER,
                "request_routing_stats_period_s": ROUTING_STATS_S,
            },
        }
        drain = self.overrides.get("drain_timeout_s")
        if drain is not None:  # Serve waits this long for open sessions before stopping a replica
            options["graceful_shutdown_timeout_s"] = float(drain)
        threads = self.overrides.get("threads", 0)
        device = str(self.overrides.get("device", ""))
        resources: dict[str, float] = {}
        if threads:  # a replica holds the CPUs its torch threads use
            resources["num_cpus"] = threads
        if device.startswith("cuda"):  # a GPU for each rank of its tensor-parallel group
            resources["num_gpus"] = int(self.overrides.get("tensor_parallel", 1))
        if resources:
            options["ray_actor_options"] = resources
        if self.replicas_min == self.replicas_max:
            options["num_replicas"] = self.replicas_min
        else:
            options["autoscaling_config"] = {
                "min_replicas": self.replicas_min,
                "max_replicas": self.replicas_max,
                "target_ongoing_requests": max(1, math.floor(cap * TARGET_LOAD)),
                "upscale_delay_s": float(self.upscale_delay_s),
                "downscale_delay_s": float(self.downscale_delay_s),
            }
        return options


def replica_config(overrides: dict[str, Any]) -> ServerConfig:
    """A replica's ServerConfig: its CLOUD_VERIFIER_<FIELD> variables, then `overrides`."""
    return replace(ServerConfig.from_env(), **overrides)


def local_cluster_env(environ: Mapping[str, str]) -> dict[str, str]:
    """What a local Ray cluster starts with beside `environ` (its processes inherit it): the
    settings of LOCAL_CLUSTER_ENV that `environ` does not set."""
    return {k: v for k, v in LOCAL_CLUSTER_ENV.items() if k not in environ}
