"""`bench.chaos --fleet`: kill fleet replicas (SIGKILL of a replica's process) while edges generate.

A fleet of `--replicas` tiny verifiers runs on a local Ray cluster started here (Serve's proxy on a
free port, the fleet's router). Each batch, `--clients` edges (the tiny torch drafter, resume on)
generate from random prompts in greedy and seeded `match` modes: once uninterrupted, then again
while one running replica, chosen at random, is killed after a random number of the first edge's
verdicts. The replicas offer their own addresses (the fleet's default), so each session moves there
(counted: `sessions_moved` of `sessions`). Every edge whose session was on the killed replica
resumes through the fleet's address on another replica and re-sends its committed tokens. Before
the next batch Serve has replaced the killed replica (reported: the time from the kill until the
fleet runs `--replicas` again, at most the batch's end, when it is first checked). Reported as
`bench.chaos`: whether every interrupted output equals its uninterrupted run, tokens lost and
repeated, the resumes' times (drop to the new welcome), and the replacement times.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import sys
import time
from typing import Any

from tqdm import tqdm

from bench.lib.stats import median

TINY_OVERRIDES = {"measure_cost": False, "max_context": 512, "kv_blocks": 2048, "threads": 1}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _running(rows: list[dict[str, Any]], killed: set[int]) -> list[dict[str, Any]]:
    """The replicas that run (Serve's state lags a kill: a killed process is not one of them)."""
    return [
        r
        for r in rows
        if r["state"] == "RUNNING" and r["pid"] is not None and r["pid"] not in killed and _alive(r["pid"])
    ]


def wait_replicas(n: int, killed: set[int], timeout_s: float = 300.0) -> list[dict[str, Any]]:
    """The fleet's running replicas once `n` run (RuntimeError after `timeout_s`)."""
    from cloud_verifier.fleet.status import fleet_status

    deadline = time.monotonic() + timeout_s
    while True:
        rows = _running([dict(r) for r in fleet_status()], killed)
        if len(rows) >= n:
            return rows
        if time.monotonic() > deadline:
            raise RuntimeError(f"the fleet did not get back to {n} running replicas in {timeout_s:.0f} s")
        time.sleep(0.2)


Job = tuple[list[int], dict[str, Any]]  # a prompt and its generate() options
Output = tuple[list[int], list[float]]  # a generation's tokens and its resumes' seconds


def _jobs(rng: random.Random, n: int) -> list[Job]:
    """`n` random requests: prompts of 4-24 tokens, greedy or seeded `match`."""
    jobs: list[Job] = []
    for _ in range(n):
        prompt = [rng.randrange(3, 49152) for _ in range(rng.randint(4, 24))]
        mode = rng.choice(["greedy", "match"])
        temperature = 0.8 if mode == "match" else 0.0
        jobs.append((prompt, {"mode": mode, "temperature": temperature, "seed": rng.randrange(2**31)}))
    return jobs


class _Edges:
    """The edges of the run (a drafter each: a drafter serves one session at a time), and the
    replicas they killed."""

    def __init__(self, url: str, clients: int, tokens: int) -> None:
        from edge_client.client import ResumeConfig
        from edge_client.drafters.registry import create_drafter

        self.url, self.tokens = url, tokens
        self.drafters = [create_drafter("torch", "tiny") for _ in range(clients)]
        self.resume = ResumeConfig(attempts=200, backoff_s=0.1, max_backoff_s=0.5)
        self.killed: set[int] = set()
        self.killed_at: list[float] = []
        self.sessions = 0  # sessions opened (resumes included), and those moved to a replica's own address
        self.moved = 0

    async def generate(self, i: int, job: Job, kill: Any) -> Output:
        """Edge `i`'s generation of `job` (its tokens, its resumes' seconds); `kill(n)` after
        each of its verdicts."""
        from edge_client.client import EdgeClient

        c = EdgeClient(self.url, self.drafters[i], resume=self.resume)
        n = 0
        async for _ in c.generate(job[0], max_new_tokens=self.tokens, raw=True, **job[1]):
            n += 1
            if kill is not None:
                kill(n)
        assert c.last is not None
        out = list(c.last.tokens)
        await c.close()
        self.sessions += 1 + len(c.resumes)
        self.moved += c.session.moves
        return out, c.resumes

    async def batch(self, jobs: list[Job], victim: int | None, at: int) -> list[Output]:
        """Every job at once, one edge each; the first edge's `at`-th verdict kills `victim`."""

        def kill(n: int) -> None:
            if victim is not None and n == at and victim not in self.killed:
                os.kill(victim, signal.SIGKILL)
                self.killed.add(victim)
                self.killed_at.append(time.monotonic())

        return await asyncio.gather(
            *(self.generate(i, job, kill if i == 0 else None) for i, job in enumerate(jobs))
        )

    def close(self) -> None:
        for d in self.drafters:
            d.close()


def run_fleet(a: argparse.Namespace) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Every interrupted generation's record (bench.chaos.record) and the fleet's own figures."""
    from bench.lib.ray_fleet import LocalFleet
    from bench.robustness.lost_tokens import record
    from cloud_verifier.fleet.config import FleetArgs

    rng = random.Random(a.seed)
    fleet = FleetArgs(
        model="tiny",
        replicas_min=a.replicas,
        replicas_max=a.replicas,
        max_sessions_per_replica=max(4, 2 * a.clients),
        overrides=TINY_OVERRIDES,
    )
    records: list[dict[str, Any]] = []
    replaced_s: list[float] = []
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with LocalFleet(num_cpus=max(2, a.replicas)) as local:
        edges = _Edges(local.url, a.clients, a.tokens)
        try:
            local.run(fleet)
            bar = tqdm(total=a.kills, desc="fleet replica kills", file=sys.stderr, disable=a.no_progress)
            while len(edges.killed) < a.kills:
                rows = wait_replicas(a.replicas, edges.killed)
                jobs = _jobs(rng, a.clients)
                wants = asyncio.run(edges.batch(jobs, None, 0))
                before = len(edges.killed)
                gots = asyncio.run(edges.batch(jobs, rng.choice(rows)["pid"], rng.randint(1, 3)))
                for (_, kw), (want, _), (got, resumes) in zip(jobs, wants, gots, strict=True):
                    records.append(record(str(kw["mode"]), want, got, resumes))
                if len(edges.killed) > before:
                    wait_replicas(a.replicas, edges.killed)
                    replaced_s.append(time.monotonic() - edges.killed_at[-1])
                bar.update(len(edges.killed) - before)
            bar.close()
        finally:
            edges.close()
    own = {
        "replicas": a.replicas,
        "clients": a.clients,
        "replica_kills": len(edges.killed),
        "replaced_s_median": median(replaced_s, 1),
        "replaced_s_max": round(max(replaced_s), 1) if replaced_s else None,
        "direct": fleet.direct,
        "sessions": edges.sessions,
        "sessions_moved": edges.moved,
    }
    return records, own
