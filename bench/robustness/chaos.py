"""Kill the verifier at random moments during generations and restart it; count what the client lost.

    python -m bench chaos --kills 100 --json bench/out/chaos.json

A `cloud-verifier serve --model tiny` process serves; an edge client (the tiny torch drafter, resume
on) generates from random prompts in greedy and seeded `match` modes. Before each generation the
same request runs uninterrupted; during the second run the verifier is killed with SIGKILL after a
random number of verdicts and a new process is started on the same port. The client reconnects,
re-sends its committed tokens and goes on. Reported: whether every interrupted output equals the
uninterrupted one, tokens lost and repeated, and the time from the drop to the new session's welcome
(which includes the new process's start).

    python -m bench chaos --fleet --kills 100 --json bench/out/chaos_fleet.json

`--fleet` kills replicas of a fleet on Ray Serve instead, under the load of several edges at once
(`chaos_fleet.py`): every edge on the killed replica resumes on another through the fleet's address.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

from bench.harness import add_common_args, figure_rows, free_port, table
from bench.lib import runner
from bench.lib.runner import Result, UsageError
from bench.robustness.lost_tokens import record, summary

if TYPE_CHECKING:
    from edge_client.drafters.base import Drafter


def _serve(port: int) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "cloud_verifier", "serve", "--model", "tiny", "--port", str(port),
           "--no-measure-cost", "--log-level", "error", "--threads", "1"]  # fmt: skip
    return subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, stderr=subprocess.DEVNULL)


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--kills", type=int, default=100, help="verifier kills (at most one per generation)")
    add_common_args(
        ap,
        json=True,
        json_help="the figures (rows: one {figure, value} each) and every generation's record",
        seed=0,
        seed_help="randomness of prompts, modes and kill moments",
        tokens=64,
        tokens_help="new tokens per generation",
        no_progress=True,
    )
    ap.add_argument(
        "--fleet",
        action="store_true",
        help="kill replicas of a fleet on Ray Serve (local cluster, the fleet extra) under the load of "
        "--clients edges at once, instead of the single verifier process",
    )
    ap.add_argument("--replicas", type=int, default=2, help="with --fleet: the fleet's replicas (>= 2)")
    ap.add_argument("--clients", type=int, default=3, help="with --fleet: edges generating at once")


def wait_ready(url: str, drafter: Drafter) -> None:
    """Wait (at most 180 s) until the first verifier process takes a session."""
    from edge_client.client import EdgeClient, GenerationError

    deadline = time.monotonic() + 180
    while True:
        try:
            asyncio.run(EdgeClient(url, drafter, resume=False).connect())
            break
        except GenerationError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def run(a: argparse.Namespace) -> Result:
    if a.kills < 1 or a.tokens < 8:
        raise UsageError("--kills >= 1 and --tokens >= 8")
    if a.fleet:
        return _fleet(a)
    from edge_client.client import EdgeClient, ResumeConfig
    from edge_client.drafters.registry import create_drafter

    rng = random.Random(a.seed)
    drafter = create_drafter("torch", "tiny")
    port = free_port()
    url = f"ws://127.0.0.1:{port}/v1/session"
    procs = [_serve(port)]
    resume = ResumeConfig(attempts=100, backoff_s=0.1, max_backoff_s=0.5)
    records: list[dict[str, Any]] = []

    async def generate(
        prompt: list[int], kw: dict[str, Any], kill_at: int | None
    ) -> tuple[list[int], list[float]]:
        c = EdgeClient(url, drafter, resume=resume)
        n = 0
        async for _ in c.generate(prompt, max_new_tokens=a.tokens, raw=True, **kw):
            n += 1
            if n == kill_at:
                procs[-1].send_signal(signal.SIGKILL)
                procs[-1].wait()
                procs.append(_serve(port))
        assert c.last is not None
        out = list(c.last.tokens)
        await c.close()
        return out, c.resumes

    try:
        wait_ready(url, drafter)
        bar = tqdm(total=a.kills, desc="chaos kills", file=sys.stderr, disable=a.no_progress)
        while len(procs) - 1 < a.kills:
            prompt = [rng.randrange(3, 49152) for _ in range(rng.randint(4, 24))]
            mode = rng.choice(["greedy", "match"])
            kw = {"mode": mode, "temperature": 0.8 if mode == "match" else 0.0, "seed": rng.randrange(2**31)}
            want, _ = asyncio.run(generate(prompt, kw, None))
            before = len(procs)
            got, resumes = asyncio.run(generate(prompt, kw, rng.randint(1, 3)))
            bar.update(len(procs) - before)
            records.append(record(mode, want, got, resumes))
    finally:
        for p in procs:
            p.kill()
            p.wait()
        drafter.close()
    result = summary(records, len(procs) - 1)
    return Result(
        figure_rows(result),
        table([[k, v] for k, v in result.items()], ["figure", "value"]),
        extra={**result, "records": records},
        status=0 if result["identical"] else 1,
    )


def _fleet(a: argparse.Namespace) -> Result:
    if a.replicas < 2 or a.clients < 1:
        raise UsageError("--fleet needs --replicas >= 2 (one to resume on) and --clients >= 1")
    try:
        import ray  # noqa: F401
    except ImportError:
        raise UsageError("--fleet needs Ray Serve: pip install -e '.[fleet]'") from None
    from bench.robustness.chaos_fleet import run_fleet

    records, own = run_fleet(a)
    result = {**summary(records, own["replica_kills"]), **own}
    return Result(
        figure_rows(result),
        table([[k, v] for k, v in result.items()], ["figure", "value"]),
        extra={**result, "records": records},
        status=0 if result["identical"] else 1,
    )


def main(argv: Sequence[str] | None = None) -> int:
    return runner.main(__name__, argv)


if __name__ == "__main__":
    sys.exit(main())
