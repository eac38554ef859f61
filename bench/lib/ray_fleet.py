"""A fleet of verifiers on a local Ray cluster, for the benches: the cluster and Serve's proxy on a
free loopback port (`LocalFleet`), the fleet a `cloud-verifier fleet` command line deploys
(`fleet_from_flags`: the same flags `cloud-verifier serve` takes), and the fleet's `/metrics`,
every replica's samples labelled `replica`, summed by a label (`labelled_totals`)."""

from __future__ import annotations

import contextlib
import os
import time
import urllib.request
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from bench.lib.procs import REPO, free_port

if TYPE_CHECKING:
    from cloud_verifier.fleet.config import FleetArgs

# what every Ray worker (each replica) starts with: this checkout importable (the echo app is
# imported by name) and sleeping OpenMP waiters, as `cloud-verifier serve` sets them
WORKER_ENV = {"PYTHONPATH": str(REPO), "OMP_WAIT_POLICY": "PASSIVE"}
ECHO_PREFIX = "/probe"  # where LocalFleet.deploy_echo serves the echo app beside the fleet


def fleet_from_flags(flags: Sequence[str], replicas: int) -> FleetArgs:
    """The fleet `cloud-verifier fleet --replicas N FLAGS` deploys (a ValueError naming what is
    wrong with the flags); needs no cluster."""
    from cloud_verifier.cli import build_parser
    from cloud_verifier.fleet.cli import fleet_args

    fleet = fleet_args(build_parser().parse_args(["fleet", "--replicas", str(replicas), *flags]))
    if isinstance(fleet, str):
        raise ValueError(fleet)
    return fleet


def add_autoscale_args(ap: Any) -> None:
    """An autoscaling bench fleet's flags (a parser or an argument group): the replicas' range,
    each one's session cap and Serve's delays."""
    ap.add_argument("--min-replicas", type=int, default=1, help="the fleet's fewest replicas")
    ap.add_argument("--max-replicas", type=int, default=3, help="the fleet's most replicas")
    ap.add_argument("--max-sessions", type=int, default=2, help="each replica's session cap")
    ap.add_argument("--upscale-delay", type=float, default=3.0, help="Serve's upscale delay (s)")
    ap.add_argument("--downscale-delay", type=float, default=15.0, help="Serve's downscale delay (s)")


def autoscaled_fleet(a: Any, direct: bool, extra: Sequence[str] = ()) -> FleetArgs:
    """The fleet `cloud-verifier fleet` deploys for `add_autoscale_args`' flags in `a` (and
    `a.model`): one thread a replica, no cost measurement at start, `--direct` or not, then
    `extra` flags; a ValueError naming what is wrong with them."""
    from cloud_verifier.cli import build_parser
    from cloud_verifier.fleet.cli import fleet_args

    flags = ["fleet", "--model", a.model, "--threads", "1", "--no-measure-cost",
             "--min-replicas", str(a.min_replicas), "--max-replicas", str(a.max_replicas),
             "--max-sessions", str(a.max_sessions), "--upscale-delay", str(a.upscale_delay),
             "--downscale-delay", str(a.downscale_delay),
             "--direct" if direct else "--no-direct", *extra]  # fmt: skip
    fleet = fleet_args(build_parser().parse_args(flags))
    if isinstance(fleet, str):
        raise ValueError(fleet)
    return fleet


def labelled_totals(text: str, family: str, label: str) -> dict[str, float]:
    """From a Prometheus exposition (the fleet's `/metrics`: every replica's samples), the samples
    of `family` (its name without `_total`) summed by the value of `label` (over replicas)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        if fam.name != family:
            continue
        for s in fam.samples:
            if s.name in (family, f"{family}_total") and label in s.labels:
                out[s.labels[label]] = out.get(s.labels[label], 0.0) + s.value
    return out


class LocalFleet:
    """A local Ray cluster of `num_cpus` logical CPUs (no dashboard), Serve's proxy on a free
    loopback port (serving TLS with `tls`, a PEM certificate and key), and the applications deployed
    on it; `with` ends them all (Serve, then Ray)."""

    def __init__(self, num_cpus: int, tls: tuple[str, str] | None = None) -> None:
        self.num_cpus = num_cpus
        self.port = free_port()
        self.tls = tls
        self._s = "s" if tls else ""

    @property
    def http(self) -> str:
        return f"http{self._s}://127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        """The fleet's session WebSocket."""
        return f"{self.base}/v1/session"

    def __enter__(self) -> LocalFleet:
        import ray
        from ray import serve

        from cloud_verifier.fleet.config import local_cluster_env

        extra = local_cluster_env(os.environ)  # the control plane `cloud-verifier fleet` starts
        os.environ.update(extra)  # (its processes inherit the environment of ray.init)
        try:
            ray.init(
                address="local",  # a cluster of its own, never one another program started here
                num_cpus=self.num_cpus,
                include_dashboard=False,
                log_to_driver=False,
                runtime_env={"env_vars": WORKER_ENV},
            )
        finally:
            for k in extra:
                del os.environ[k]
        try:
            tls = {"ssl_certfile": self.tls[0], "ssl_keyfile": self.tls[1]} if self.tls else {}
            serve.start(http_options={"host": "127.0.0.1", "port": self.port, **tls})
        except BaseException:
            ray.shutdown()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        import ray
        from ray import serve

        shutdown: Callable[[], None] = serve.shutdown  # (untyped in Ray)
        try:
            shutdown()
        finally:
            ray.shutdown()

    @property
    def base(self) -> str:
        """The proxy's WebSocket base: ws://127.0.0.1:PORT (wss:// with TLS)."""
        return f"ws{self._s}://127.0.0.1:{self.port}"

    def deploy(self, flags: Sequence[str], replicas: int) -> FleetArgs:
        """Deploy the fleet of `fleet_from_flags(flags, replicas)` (`run`)."""
        return self.run(fleet_from_flags(flags, replicas))

    def run(self, fleet: FleetArgs) -> FleetArgs:
        """Deploy `fleet` at `/` (in place of one deployed before) and wait until every replica is
        ready."""
        from ray import serve

        from cloud_verifier.fleet.app import build
        from cloud_verifier.fleet.config import APP_NAME

        self.delete(APP_NAME)  # fresh replicas for each fleet
        serve.run(build(fleet), name=APP_NAME, route_prefix="/")
        return fleet

    def deploy_echo(self) -> str:
        """Deploy the echo app (bench.lib.echo) at ECHO_PREFIX, one replica holding no CPU; returns
        its HTTP base."""
        from ray import serve
        from ray.serve import Deployment

        from bench.lib.echo import echo_app

        echo: Deployment = serve.deployment(name="Echo", num_replicas=1, ray_actor_options={"num_cpus": 0})(
            serve.ingress(echo_app)()
        )
        serve.run(echo.bind(), name="echo", route_prefix=ECHO_PREFIX)
        return self.http + ECHO_PREFIX

    def delete(self, name: str) -> None:
        """Delete the application `name` if it is deployed (its replicas stop)."""
        from ray import serve

        if name in serve.status().applications:
            serve.delete(name)

    def metrics(self) -> str:
        """The fleet's `/metrics` through its proxy: every replica's samples (each reports every
        second), labelled `replica` and `node`."""
        with urllib.request.urlopen(self.http + "/metrics", timeout=30) as r:
            text: str = r.read().decode()
        return text

    def replica_pids(self, replicas: int, timeout_s: float = 30.0) -> list[int]:
        """The PIDs of the fleet's running replicas, once `replicas` of them have reported (every
        second), in order."""
        from cloud_verifier.fleet.status import fleet_status

        deadline = time.monotonic() + timeout_s
        while True:
            pids = sorted(int(r["pid"]) for r in fleet_status() if r["state"] == "RUNNING" and r["pid"])
            if len(pids) >= replicas or time.monotonic() > deadline:
                return pids
            time.sleep(0.5)

    def totals(
        self, family: str, label: str, at_least: float = 0.0, timeout_s: float = 30.0
    ) -> dict[str, float]:
        """`labelled_totals` of the fleet's metrics, read again (twice a second, for at most
        `timeout_s`) until they add up to `at_least` (the replicas report every second)."""
        deadline = time.monotonic() + timeout_s
        while True:
            got = labelled_totals(self.metrics(), family, label)
            if sum(got.values()) >= at_least or time.monotonic() > deadline:
                return got
            time.sleep(0.5)


def pin(pids: Sequence[int], cores_each: int) -> list[list[int]]:
    """Confine each process of `pids` to cores of its own (`taskset -p` for every thread it has;
    threads it starts later inherit it): the i-th to the i-th run of `cores_each` cores, wrapping
    around the cores this process may use. Returns each one's cores."""
    import os

    cores = sorted(os.sched_getaffinity(0))
    out = []
    for i, pid in enumerate(pids):
        mine = [cores[(i * cores_each + k) % len(cores)] for k in range(cores_each)]
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(ProcessLookupError):  # (a thread that just ended)
                os.sched_setaffinity(int(tid), mine)
        out.append(mine)
    return out


def ray_missing() -> str | None:
    """Why the fleet cannot run here (Ray Serve not installed), or None."""
    try:
        import ray.serve  # noqa: F401
    except ImportError:
        return "the fleet needs Ray Serve: pip install -e '.[fleet]'"
    return None
