"""bench.fleet's control_plane part: the CPU a fleet's local Ray cluster takes beside its replicas
(the Serve controller and proxy, GCS, the raylet, the fleet's board, Ray's agents), with two
replicas deployed and no load, from each process's CPU time in /proc (Linux).

The cluster's processes are the descendants of the bench's own process, which started the cluster:
no other program's processes count. On a machine with as many cores as replicas, this CPU comes out
of the replicas' share (the throughput part's two replicas on two cores)."""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from bench.lib.ray_fleet import LocalFleet

# a process's kind, by a part of its command line (the first that matches), else "other"
KINDS = (
    ("ServeReplica", "replica"),
    ("ServeController", "Serve controller"),
    ("ProxyActor", "Serve proxy"),
    ("_Board", "fleet board"),
    ("gcs_server", "GCS"),
    ("raylet", "raylet"),
    ("DashboardAgent", "dashboard agent"),
    ("RuntimeEnvAgent", "runtime env agent"),
    ("dashboard", "dashboard"),
    ("log_monitor", "log monitor"),
    ("monitor.py", "autoscaler monitor"),
)
SETTLE_S = 5.0  # after the replicas are up, before the sampling starts


def kind(cmdline: str) -> str:
    """The kind of a Ray process by its command line (KINDS)."""
    return next((name for part, name in KINDS if part in cmdline), "other")


def descendants(root: int) -> list[int]:
    """The PIDs of every process under `root` (children, theirs, ...), from /proc."""
    parent: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = _stat(int(entry))
            if stat is not None:
                parent[int(entry)] = int(stat[1])
    found: list[int] = []
    frontier = [root]
    while frontier:
        pid = frontier.pop()
        kids = [p for p, pp in parent.items() if pp == pid]
        found += kids
        frontier += kids
    return sorted(found)


def _stat(pid: int) -> list[str] | None:
    """/proc/PID/stat's fields after the command name (state first), None if the process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    return text[text.rindex(")") + 2 :].split()


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of `pid` so far (None: gone)."""
    stat = _stat(pid)
    if stat is None:
        return None
    return (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def sample(pids: Iterable[int]) -> dict[int, tuple[str, float]]:
    """Each live process's (kind, CPU seconds)."""
    out = {}
    for pid in pids:
        seconds = cpu_seconds(pid)
        if seconds is not None:
            out[pid] = (kind(cmdline(pid)), seconds)
    return out


def shares(
    before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]], seconds: float
) -> list[dict[str, Any]]:
    """Rows of % of one core by kind over `seconds` (processes in both samples), largest first, then
    the total of every kind but the replicas."""
    by_kind: dict[str, list[float]] = {}
    for pid, (name, end) in after.items():
        if pid in before:
            by_kind.setdefault(name, []).append(end - before[pid][1])
    pct = {name: round(sum(used) / seconds * 100, 1) for name, used in by_kind.items()}
    order = sorted(pct, key=lambda name: -pct[name])
    rows: list[dict[str, Any]] = [
        {"part": "control_plane", "process": name, "processes": len(by_kind[name]), "cpu_pct": pct[name]}
        for name in order
    ]
    others = [name for name in order if name != "replica"]
    rows.append({"part": "control_plane", "process": "all but the replicas",
                 "processes": sum(len(by_kind[n]) for n in others),
                 "cpu_pct": round(sum(pct[n] for n in others), 1)})  # fmt: skip
    return rows


def control_plane(a: argparse.Namespace, fleet: LocalFleet, flags: list[str]) -> list[dict[str, Any]]:
    """The part's rows: two replicas of `cloud-verifier fleet FLAGS`, idle, sampled over --seconds."""
    fleet.deploy(flags, 2)
    fleet.replica_pids(2)  # both up and reporting
    time.sleep(SETTLE_S)
    pids = descendants(os.getpid())
    before = sample(pids)
    start = time.monotonic()
    time.sleep(a.seconds)
    after = sample(pids)
    return shares(before, after, time.monotonic() - start)
