"""bench.fleet's throughput part: tokens/s of a fleet of 1 replica, then of 2, under the same loads
of raw-protocol clients (`throughput`), and the same loads on 1 and 2 plain `cloud-verifier serve`
processes with no Ray (`plain_throughput`), the machine's own scaling; each row a load
(`_load_row`)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

from bench.lib.procs import Verifier

if TYPE_CHECKING:
    from bench.lib.raw_sessions import Proposer
    from bench.lib.ray_fleet import LocalFleet
    from shared.tree import TokenTree


def replica_split(before: Mapping[str, float], after: Mapping[str, float]) -> str:
    """Each replica's share of what it emitted between two readings of a per-replica counter, in %,
    largest first ("52/48"); replicas that emitted nothing (gone ones still reported) left out."""
    deltas = [after[r] - before.get(r, 0.0) for r in after]
    deltas = sorted((d for d in deltas if d > 0), reverse=True)
    total = sum(deltas)
    return "/".join(f"{d / total * 100:.0f}" for d in deltas) if total else "-"


def cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _trees(a: argparse.Namespace) -> Proposer | None:
    """The load clients' trees: prompt-lookup (greedy), or none (`ar`)."""
    from bench.serving.proposer import LookupConfig, propose

    lookup = LookupConfig()

    def proposer(committed: Sequence[int]) -> TokenTree:
        return propose(committed, lookup)

    return proposer if a.load == "greedy" else None


def _loads(a: argparse.Namespace, replicas: int) -> list[int]:
    """The client counts a fleet of `replicas` runs under."""
    return [a.clients] if a.clients_per_replica is None else [n * replicas for n in a.clients_per_replica]


def _cores_text(cores: Sequence[Sequence[int]]) -> str:
    return " | ".join(",".join(map(str, c)) for c in cores) or "any"


def throughput(
    a: argparse.Namespace, fleet: LocalFleet, fp: str, vocab: int, flags: Sequence[str]
) -> list[dict[str, Any]]:
    """tokens/s of a fleet (of `cloud-verifier fleet FLAGS`) of 1 replica, then of 2, under the same
    loads (per replica, with --clients-per-replica)."""
    from bench.lib.ray_fleet import pin

    trees = _trees(a)
    rows = []
    for replicas in (1, 2):
        fleet.deploy(flags, replicas)
        cores = pin(fleet.replica_pids(replicas), a.threads) if a.pin else []
        for clients in _loads(a, replicas):
            before = fleet.totals("specdec_emitted_tokens", "replica")
            row = _load_row(a, [fleet.url], fp, vocab, trees, replicas, clients, "ray", a.direct)
            time.sleep(1.5)  # each replica reports its metrics every second
            split = replica_split(before, fleet.totals("specdec_emitted_tokens", "replica"))
            rows.append({**row, "by_replica_pct": split, "cores": _cores_text(cores)})
    return rows


def plain_throughput(
    a: argparse.Namespace, fp: str, vocab: int, serve_args: Sequence[str]
) -> list[dict[str, Any]]:
    """The same loads on 1, then 2 `cloud-verifier serve` processes with no Ray, each on
    --threads cores of its own, the clients spread over them in turn: what the machine itself
    gives a second verifier, the ceiling of the fleet's scaling."""
    trees = _trees(a)
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(cpu_count()))
    rows = []
    for n in (1, 2):
        cores = [[cpus[(i * a.threads + k) % len(cpus)] for k in range(a.threads)] for i in range(n)]
        with contextlib.ExitStack() as stack:
            urls = [
                stack.enter_context(Verifier(a.model, cores=c, threads=a.threads, args=serve_args)).url
                for c in cores
            ]
            for clients in _loads(a, n):
                row = _load_row(a, urls, fp, vocab, trees, n, clients, "plain", False)
                rows.append({**row, "by_replica_pct": "-", "cores": _cores_text(cores)})
    return rows


def _load_row(
    a: argparse.Namespace,
    urls: Sequence[str],
    fp: str,
    vocab: int,
    trees: Proposer | None,
    replicas: int,
    clients: int,
    system: str,
    direct: bool,
) -> dict[str, Any]:
    """One throughput row: `clients` spread over `urls` (a fleet's address, or plain verifiers) of
    `replicas` verifiers."""
    from bench.lib.raw_sessions import LoadTally, session_load

    bar = tqdm(
        total=a.seconds,
        desc=f"{system} throughput, {replicas} verifier{'s' if replicas > 1 else ''}, {clients} clients",
        file=sys.stderr,
        disable=a.no_progress,
        bar_format="{desc}: {bar} {n:.0f}/{total:.0f} s{postfix}",
    )

    def tick(at: float, tally: LoadTally) -> None:
        bar.n = min(max(at, 0.0), a.seconds)
        bar.set_postfix_str(f"{tally.tokens / at:.0f} tok/s" if at >= 1 else "warming up")

    window = (a.warmup, a.seconds)
    load = session_load(urls, fp, clients, a.tokens, window, a.seed, vocab, trees, tick, direct)
    tally = asyncio.run(load)
    bar.n = a.seconds
    bar.close()
    return {
        "part": "throughput",
        "system": system,
        "replicas": replicas,
        "clients": clients,
        "load": a.load,
        "direct": direct,
        "seconds": a.seconds,
        "tokens": tally.tokens,
        "tokens_per_s": round(tally.tokens / a.seconds, 1),
        "sessions": tally.sessions,
        "errors": len(tally.errors),
        "first_errors": sorted(set(tally.errors))[:3],
    }
