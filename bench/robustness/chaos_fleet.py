"""`bench.chaos --fleet`: kill fleet replicas (SIGKILL of a replica's process) while edges generate.

A fleet of `--replicas` tiny verifiers runs on a local Ray cluster started here (Serve's proxy on a
free port, the fleet's router). Each batch, `--clients` edges (the tiny torch drafter, resume on)
generate from random prompts in greedy and seeded `match` modes: once uninterrupted, then again
while one running replica, chosen at random, is killed after a random number of the first edge's
verdicts. Every edge whose session was on the killed replica resumes through the fleet's address
on another replica and re-sends its committed tokens. Before the next batch Serve has replaced the
killed replica (reported: the time from the kill until the fleet runs `--replicas` again, at most
the batch's end, when it is first checked). Reported as `bench.chaos`: whether every interrupted
output equals its uninterrupted run, tokens lost and repeated, the resumes' times (drop to the new
welcome), and the replacement times.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

from tqdm import tqdm

from bench.harness import free_port
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


def run_fleet(a: argparse.Namespace) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Every interrupted generation's record (bench.chaos.record) and the fleet's own figures."""
    import ray
    from ray import serve

    from bench.robustness.chaos import record
    from cloud_verifier.fleet.app import build
    from cloud_verifier.fleet.config import APP_NAME, FleetArgs
    from edge_client.client import EdgeClient, ResumeConfig
    from edge_client.drafters.registry import create_drafter

    rng = random.Random(a.seed)
    port = free_port()
    url = f"ws://127.0.0.1:{port}/v1/session"
    fleet = FleetArgs(
        model="tiny",
        replicas_min=a.replicas,
        replicas_max=a.replicas,
        max_sessions_per_replica=max(4, 2 * a.clients),
        overrides=TINY_OVERRIDES,
    )
    resume = ResumeConfig(attempts=200, backoff_s=0.1, max_backoff_s=0.5)
    records: list[dict[str, Any]] = []
    replaced_s: list[float] = []
    kills = 0
    killed: set[int] = set()
    killed_at: list[float] = []
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ray.init(num_cpus=max(2, a.replicas), include_dashboard=False, log_to_driver=False)
    drafters = [create_drafter("torch", "tiny") for _ in range(a.clients)]  # one per edge
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build(fleet), name=APP_NAME, route_prefix="/")

        async def generate(
            i: int, prompt: list[int], kw: dict[str, Any], on_verdict: Any
        ) -> tuple[list[int], list[float]]:
            c = EdgeClient(url, drafters[i], resume=resume)
            n = 0
            async for _ in c.generate(prompt, max_new_tokens=a.tokens, raw=True, **kw):
                n += 1
                if on_verdict is not None:
                    await on_verdict(n)
            assert c.last is not None
            out = list(c.last.tokens)
            await c.close()
            return out, c.resumes

        async def batch(jobs: list[tuple[list[int], dict[str, Any]]], victim: int | None, at: int) -> Any:
            async def kill(n: int) -> None:
                nonlocal kills
                if victim is not None and n == at and victim not in killed:
                    os.kill(victim, signal.SIGKILL)
                    killed.add(victim)
                    kills += 1
                    killed_at.append(time.monotonic())

            return await asyncio.gather(
                *(generate(i, p, kw, kill if i == 0 else None) for i, (p, kw) in enumerate(jobs))
            )

        bar = tqdm(total=a.kills, desc="fleet replica kills", file=sys.stderr, disable=a.no_progress)
        while kills < a.kills:
            rows = wait_replicas(a.replicas, killed)
            jobs: list[tuple[list[int], dict[str, Any]]] = []
            for _ in range(a.clients):
                prompt = [rng.randrange(3, 49152) for _ in range(rng.randint(4, 24))]
                mode = rng.choice(["greedy", "match"])
                temperature = 0.8 if mode == "match" else 0.0
                kw = {"mode": mode, "temperature": temperature, "seed": rng.randrange(2**31)}
                jobs.append((prompt, kw))
            wants = asyncio.run(batch(jobs, None, 0))
            victim = rng.choice(rows)["pid"]
            before = kills
            gots = asyncio.run(batch(jobs, victim, rng.randint(1, 3)))
            for (_, kw), (want, _), (got, resumes) in zip(jobs, wants, gots, strict=True):
                records.append(record(str(kw["mode"]), want, got, resumes))
            if kills > before:
                wait_replicas(a.replicas, killed)
                replaced_s.append(time.monotonic() - killed_at[-1])
            bar.update(kills - before)
        bar.close()
    finally:
        for d in drafters:
            d.close()
        shutdown: Callable[[], None] = serve.shutdown  # (untyped in Ray)
        shutdown()
        ray.shutdown()
    own = {
        "replicas": a.replicas,
        "clients": a.clients,
        "replica_kills": kills,
        "replaced_s_median": median(replaced_s, 1),
        "replaced_s_max": round(max(replaced_s), 1) if replaced_s else None,
    }
    return records, own
