"""Where `bench.serve`'s requests go (`server`): a running verifier (`--url`), one started for the
runs, or with `--fleet` an autoscaling fleet of verifiers on Ray Serve, read over time.

The bench starts a local Ray cluster and deploys `cloud-verifier fleet` on it (`--model`, one
thread a replica, autoscaling between `--min-replicas` and `--max-replicas` on sessions per
replica, `--max-sessions` each, Serve's `--upscale-delay` / `--downscale-delay`). Every request of
every client kind goes through the fleet's one address: `ar`'s HTTP completions as Serve routes
them, and the edge kinds' sessions, each opened for its request (`--session-per-request`, the
default with `--fleet`) so that the router places it when it arrives, as a user's session would be
placed. A session refused at every replica's cap ("try again later", 1013) is tried again for about
two minutes (serve_clients.PATIENT), its wait counted in its TTFT.

The rates of `--request-rate` run in the order given, each kind in turn, on the same fleet: a
rising list is a rising load. A thread reads the fleet twice a second (`fleet status`: replicas
running and starting, their open sessions and engine queues); after the last run the bench waits
(at most `--cool-seconds`) until the fleet is back at `--min-replicas`. Each row gains the most and
fewest replicas running during its run; the result gains `fleet` (the figures below) and
`fleet_timeline`; `--fleet-plot` draws replicas and the request rate, sessions, and every
request's time per output token against time.

Figures: the most replicas reached, the seconds from the first run's start to the first added
replica, from the last run's end back to the minimum, and the requests that failed (a session a
stopping replica ended would fail here).
"""

from __future__ import annotations

import argparse
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.end_to_end.e2e import trusted_key_file
from bench.harness import Verifier
from bench.lib.ray_fleet import LocalFleet, add_autoscale_args, autoscaled_fleet, ray_missing
from bench.lib.runner import UsageError
from bench.serving.serve_clients import Run, ServeBenchError, stochastic

SAMPLE_S = 0.5  # the fleet is read this often


def add_fleet_args(p: argparse.ArgumentParser) -> None:
    """The flags of `--fleet`: the fleet started and what the bench reads of it."""
    g = p.add_argument_group("fleet (--fleet: an autoscaling fleet on Ray Serve instead of one verifier)")
    g.add_argument(
        "--fleet",
        action="store_true",
        help="start `cloud-verifier fleet` of --model on a local Ray cluster (one thread a replica) "
        "and run every kind and rate through its one address; the rates run in the order given "
        "on the same fleet, which is read twice a second (needs the fleet extra: pip install -e '.[fleet]')",
    )
    add_autoscale_args(g)
    g.add_argument(
        "--fleet-direct",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the replicas offer their own addresses and edge sessions move there "
        "(`cloud-verifier fleet --direct`); default: on, off with --rtt-ms (a moved session "
        "would leave the delay proxy's link)",
    )
    g.add_argument(
        "--cool-seconds",
        type=float,
        default=180.0,
        help="after the last run, the most seconds to wait for the fleet to shrink back to --min-replicas",
    )
    g.add_argument(
        "--fleet-plot",
        type=Path,
        default=None,
        metavar="PATH",
        help="a PNG of replicas and request rate, sessions and queues, and each request's time per "
        "output token, against time",
    )
    g.add_argument(
        "--session-per-request",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="each edge request opens a session of its own and closes it after (default with "
        "--fleet); without: each in-flight slot keeps one session for all its requests",
    )


def check_fleet_args(args: argparse.Namespace) -> None:
    """--fleet's flags resolved; a usage error for a combination that cannot run."""
    if args.session_per_request is None:
        args.session_per_request = bool(args.fleet)
    if not args.fleet:
        if args.fleet_plot is not None:
            raise UsageError("--fleet-plot draws the fleet: it needs --fleet")
        return
    why = ray_missing()
    if why:
        raise UsageError(f"--fleet: {why}")
    if args.url is not None or args.in_process:
        raise UsageError("--fleet starts the fleet itself: leave out --url and --in-process")
    if not 1 <= args.min_replicas <= args.max_replicas:
        raise UsageError("--min-replicas must be at least 1 and at most --max-replicas")
    if args.max_sessions < 1 or args.upscale_delay < 0 or args.downscale_delay < 0:
        raise UsageError("--max-sessions >= 1 and the delays >= 0")
    if args.fleet_direct is None:
        args.fleet_direct = not args.rtt_ms
    if args.fleet_direct and args.rtt_ms:
        raise UsageError(
            "--fleet-direct with --rtt-ms: a session moved to its replica's own address would leave "
            "the delay proxy's link; use --no-fleet-direct"
        )


@dataclass
class FleetRun:
    """The fleet while the bench runs: its address, and the samples the reader thread takes."""

    http: str
    min_replicas: int
    timeline: list[dict[str, Any]] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def sample(self) -> None:
        """Read the fleet every SAMPLE_S until `stop` (a failed read is skipped, not fatal)."""
        from cloud_verifier.fleet.status import fleet_status

        while not self.stop.is_set():
            try:
                rows = fleet_status()
            except Exception:  # Serve busy answering: the next read will do
                rows = None
            if rows is not None:
                running = [r for r in rows if r["state"] == "RUNNING"]
                self.timeline.append(
                    {
                        "time": round(time.time(), 3),
                        "replicas": len(running),
                        "starting": sum(1 for r in rows if r["state"] in ("STARTING", "PENDING_MIGRATION")),
                        "sessions": sum(r["sessions"] or 0 for r in running),
                        "queue": sum(r["queue"] or 0 for r in running),
                        "generations": sum(r["generations"] or 0 for r in running),
                    }
                )
            self.stop.wait(SAMPLE_S)

    def back_to_min(self, cool_s: float) -> None:
        """Wait (at most `cool_s`) until two samples in a row show the fleet at its minimum."""
        deadline = time.monotonic() + cool_s
        while time.monotonic() < deadline:
            last = self.timeline[-2:]
            if (
                len(last) == 2
                and all(s["replicas"] == self.min_replicas for s in last)
                and time.time() - last[0]["time"] < 5
            ):
                return
            time.sleep(SAMPLE_S)


@contextmanager
def fleet(args: argparse.Namespace) -> Iterator[FleetRun]:
    """The fleet of --model (see the module docstring), read twice a second while it lives; on a
    clean exit, the cool-down wait first."""
    from ray import serve

    from cloud_verifier.fleet.app import build
    from cloud_verifier.fleet.config import APP_NAME

    flags = ["--max-context", str(args.max_context)]
    if args.kv_blocks:
        flags += ["--kv-blocks", str(args.kv_blocks)]
    if any(stochastic(c) for c in args.clients):  # mss / rrs: a trusted key, sent by every request
        key_file, args.api_key = trusted_key_file()
        flags += ["--api-key-file", str(key_file)]
    try:
        spec = autoscaled_fleet(args, args.fleet_direct, flags)
    except ValueError as exc:
        raise UsageError(f"--fleet: {exc}") from None
    with LocalFleet(num_cpus=args.max_replicas) as local:
        serve.run(build(spec), name=APP_NAME, route_prefix="/")
        run = FleetRun(local.http, args.min_replicas)
        reader = threading.Thread(target=run.sample, name="fleet-reader", daemon=True)
        reader.start()
        try:
            yield run
            run.back_to_min(args.cool_seconds)
        finally:
            run.stop.set()
            reader.join(timeout=35)


@dataclass
class Server:
    """The runs' server: its base URL, and with --fleet the fleet's run (else None)."""

    http: str
    fleet: FleetRun | None = None


@contextmanager
def server(args: argparse.Namespace) -> Iterator[Server]:
    """--url's verifier, the fleet of --fleet, or one verifier started for the runs (a child
    process, or with --in-process a thread of this process serving a target loaded here)."""
    if args.url is not None:
        yield Server(args.url.rstrip("/"))
        return
    if args.fleet:
        with fleet(args) as run:
            yield Server(run.http, run)
        return
    extra = ["--no-measure-cost", "--max-context", str(args.max_context)]
    if args.kv_blocks:
        extra += ["--kv-blocks", str(args.kv_blocks)]
    key_file = None
    if any(stochastic(c) for c in args.clients):  # mss / rrs: a trusted key, sent by every request
        key_file, args.api_key = trusted_key_file()
        extra += ["--api-key-file", str(key_file)]
    if not args.in_process:
        with Verifier(args.model, threads=args.threads, args=extra, echo=not args.no_progress) as v:
            yield Server(v.http)
        return
    import logging

    from cloud_verifier.server import ThreadedServer
    from cloud_verifier.server_config import ServerConfig

    logging.getLogger("cloud_verifier.auth").setLevel(logging.ERROR)  # open access on loopback
    config = ServerConfig(
        model=args.model,
        threads=args.threads,
        kv_blocks=args.kv_blocks,
        max_context=args.max_context,
        measure_cost=False,
        log_level="warning",
        api_key_file=None if key_file is None else str(key_file),
    )
    threaded = ThreadedServer(config)
    try:
        threaded.start(timeout=600)
    except RuntimeError as exc:
        raise ServeBenchError(str(exc)) from None
    try:
        yield Server(threaded.http)
    finally:
        threaded.stop()


# --------------------------------------------------------------------------------------- figures
def annotate(rows: Sequence[dict[str, Any]], timeline: Sequence[dict[str, Any]]) -> None:
    """Each row's most and fewest replicas running during its run: the samples taken in it and
    the last one before it (None: no sample then)."""
    for r in rows:
        before = [s for s in timeline if s["time"] < r["wall_start"]][-1:]
        seen = [
            s["replicas"]
            for s in before + [s for s in timeline if r["wall_start"] <= s["time"] <= r["wall_end"]]
        ]
        r["replicas_max"] = max(seen, default=None)
        r["replicas_min"] = min(seen, default=None)


def figures(
    rows: Sequence[dict[str, Any]], timeline: Sequence[dict[str, Any]], min_replicas: int
) -> dict[str, Any]:
    """The run's fleet figures (see the module docstring)."""
    start = min((r["wall_start"] for r in rows), default=None)
    end = max((r["wall_end"] for r in rows), default=None)
    up = next((s["time"] for s in timeline if s["replicas"] > min_replicas), None)
    back = next(
        (
            s["time"]
            for s in timeline
            if end is not None and s["time"] >= end and s["replicas"] == min_replicas
        ),
        None,
    )
    return {
        "replicas_max": max((s["replicas"] for s in timeline), default=0),
        "first_scale_up_s": None if up is None or start is None else round(up - start, 1),
        "back_to_min_s_after_load": None if back is None or end is None else round(back - end, 1),
        "requests": sum(int(r["completed"]) + int(r["failed"]) for r in rows),
        "failed": sum(int(r["failed"]) for r in rows),
    }


def results(args: argparse.Namespace, runs: Sequence[Run], run: FleetRun) -> dict[str, Any]:
    """The result's fleet keys (`fleet`: the figures, `fleet_timeline`), each row annotated with
    its replicas, and --fleet-plot drawn."""
    rows = [r.row for r in runs]
    annotate(rows, run.timeline)
    fig = figures(rows, run.timeline, args.min_replicas)
    if args.fleet_plot is not None:
        done = [(r.row["client"], x.sent_at + x.latency, x.tpot) for r in runs for x in r.results if x.ok]
        title = (
            f"bench.serve on a fleet of {args.model}: {args.min_replicas}-{args.max_replicas} replicas, "
            f"{args.max_sessions} sessions each (delays {args.upscale_delay:g}/{args.downscale_delay:g} s)"
        )
        plot(rows, run.timeline, done, title, args.fleet_plot)
    return {"fleet": fig, "fleet_timeline": run.timeline}


def render(fig: dict[str, Any]) -> str:
    return "fleet: " + ", ".join(f"{k} {v}" for k, v in fig.items())


def plot(
    rows: Sequence[dict[str, Any]],
    timeline: Sequence[dict[str, Any]],
    requests: Sequence[tuple[str, float, float | None]],
    title: str,
    path: Path,
) -> None:
    """Replicas and the request rate (top), sessions and queues (middle), and each request's time
    per output token at its end, a colour per client kind (bottom), against seconds from the start.
    `requests`: (client, end time, TPOT seconds) of every completed request."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from bench.harness import save_figure

    t0 = min([s["time"] for s in timeline] + [r["wall_start"] for r in rows])
    fig, (rep, ses, lat) = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
    t = [s["time"] - t0 for s in timeline]
    rep.step(t, [s["replicas"] for s in timeline], where="post", label="replicas running")
    rep.step(t, [s["starting"] for s in timeline], where="post", alpha=0.5, label="replicas starting")
    rep.set_ylabel("replicas")
    rep.set_ylim(-0.1, max([s["replicas"] + s["starting"] for s in timeline], default=1) + 0.6)
    rep.yaxis.get_major_locator().set_params(integer=True)
    rep.legend(fontsize=8, loc="upper left")
    rate = rep.twinx()
    for r in rows:  # each run: its client kind and rate over its span
        x = (r["wall_start"] - t0, r["wall_end"] - t0)
        value = min(float(r["request_rate"]), 1e3)
        rate.plot(x, (value, value), color="C3", lw=2, alpha=0.6)
        rate.annotate(f"{r['client']} {value:g}/s", (x[0], value), fontsize=7, color="C3",
                      xytext=(0, 3), textcoords="offset points")  # fmt: skip
    rate.set_ylim(0, max((min(float(r["request_rate"]), 1e3) for r in rows), default=1) * 1.3)
    rate.set_ylabel("request rate (req/s)", color="C3")
    ses.plot(t, [s["sessions"] for s in timeline], label="open sessions")
    ses.plot(t, [s["generations"] for s in timeline], label="slots in use (sessions + HTTP generations)")
    ses.plot(t, [s["queue"] for s in timeline], label="engine queues", alpha=0.7)
    ses.set_ylabel("all replicas")
    ses.legend(fontsize=8)
    kinds = list(dict.fromkeys(c for c, _, _ in requests))
    for i, kind in enumerate(kinds):
        mine = [(end - t0, tpot * 1e3) for c, end, tpot in requests if c == kind and tpot is not None]
        lat.scatter([x for x, _ in mine], [y for _, y in mine], s=8, color=f"C{i % 10}", label=kind)
    if kinds:
        lat.legend(fontsize=8)
    lat.set_ylabel("TPOT ms (each request, at its end)")
    lat.set_xlabel("seconds")
    fig.suptitle(title, fontsize=10)
    save_figure(fig, path, dpi=120)
