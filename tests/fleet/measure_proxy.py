"""What Ray Serve's proxy adds to a WebSocket round trip: the same app connected to directly
(uvicorn on loopback, a process of its own) and through Serve's proxy (one replica, a local Ray
cluster on the same machine).

    python -m tests.fleet.measure_proxy [--frames 200] [--reps 3] [--tokens 48] [--sessions 3]

Each direct and through the proxy: a WebSocket echo of 64-byte frames (the proxy alone: connect and
round trip), GET /healthz, and real verify rounds of greedy sessions on the tiny model (the
verifier as `cloud-verifier serve` runs it and as a fleet replica does, the same flags; the
prompt's round apart, it carries the prefill). Prints one JSON object: medians and 90th
percentiles in milliseconds, and whether both generated the same tokens.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
from websockets.sync.client import connect

from tests.cloud_verifier.service import prompt_tokens, tiny
from tests.fleet.echo import echo_app
from tests.fleet.wsclient import greedy_session

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# the verifier of both measurements: `cloud-verifier serve` and each fleet replica
VERIFIER_FLAGS = ["--model", "tiny", "--threads", "1", "--no-measure-cost", "--kv-blocks", "2048"]
VERIFIER_FLAGS += ["--max-context", "512", "--max-sessions", "8", "--log-level", "warning"]


@contextlib.contextmanager
def serving(argv: list[str], ready_url: str) -> Iterator[None]:
    """Run `argv` in a process of its own until `ready_url` answers 200; stop it afterwards."""
    proc = subprocess.Popen(argv, cwd=ROOT)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, f"{argv} did not start"
            try:
                if httpx.get(ready_url).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        yield
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def summary(seconds: list[float]) -> dict[str, float]:
    ms = sorted(s * 1e3 for s in seconds)
    return {
        "n": len(ms),
        "median_ms": round(statistics.median(ms), 3),
        "p90_ms": round(ms[int(0.9 * (len(ms) - 1))], 3),
    }


def echo_rounds(url: str, frames: int) -> tuple[float, list[float]]:
    """(seconds to connect, seconds of each frame's round trip)."""
    t0 = time.perf_counter()
    with connect(url) as ws:
        opened = time.perf_counter() - t0
        payload = b"x" * 64
        times = []
        for _ in range(frames):
            t = time.perf_counter()
            ws.send(payload)
            assert ws.recv(30) == payload
            times.append(time.perf_counter() - t)
    return opened, times


def http_rounds(base: str, n: int) -> list[float]:
    times = []
    with httpx.Client(base_url=base) as c:
        for _ in range(n):
            t = time.perf_counter()
            assert c.get("/healthz").status_code == 200
            times.append(time.perf_counter() - t)
    return times


def measure_echo(base_http: str, base_ws: str, frames: int, reps: int) -> dict[str, Any]:
    connects, rtts = [], []
    for _ in range(reps):
        opened, times = echo_rounds(f"{base_ws}/echo", frames)
        connects.append(opened)
        rtts.extend(times[5:])  # the first frames warm up
    return {
        "connect": summary(connects),
        "frame_rtt": summary(rtts),
        "healthz": summary(http_rounds(base_http, frames)[5:]),
    }


def measure_verify(url: str, tokens: int, sessions: int) -> dict[str, Any]:
    rounds, firsts, outs = [], [], []
    for i in range(sessions):
        out, times = greedy_session(url, prompt_tokens(100 + i), tokens, seed=i)
        firsts.append(times[0])  # the prompt's round carries the prefill
        rounds.extend(times[1:])
        outs.append(out)
    return {
        "round": summary(rounds),
        "prompt_round": summary(firsts),
        "tokens": outs,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--frames", type=int, default=200)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--sessions", type=int, default=3)
    args = p.parse_args()

    import ray
    from ray import serve
    from ray.serve import Deployment

    from cloud_verifier.cli import build_parser
    from cloud_verifier.fleet.app import build
    from cloud_verifier.fleet.cli import fleet_args
    from cloud_verifier.fleet.config import APP_NAME, FleetArgs

    result: dict[str, Any] = {}
    # direct: the echo app on uvicorn, and the verifier as `cloud-verifier serve` runs it, each in
    # a process of its own (as a replica is: in this one they would share the client's GIL)
    port = free_port()
    echo_cmd = [
        sys.executable,
        "-m",
        "uvicorn",
        "tests.fleet.echo:echo_app",
        "--factory",
        "--port",
        str(port),
    ]
    with serving([*echo_cmd, "--log-level", "warning"], f"http://127.0.0.1:{port}/healthz"):
        base = f"127.0.0.1:{port}"
        result["echo_direct"] = measure_echo(f"http://{base}", f"ws://{base}", args.frames, args.reps)
    tiny()
    port = free_port()
    verifier = [sys.executable, "-m", "cloud_verifier", "serve", "--port", str(port), *VERIFIER_FLAGS]
    with serving(verifier, f"http://127.0.0.1:{port}/readyz"):
        url = f"ws://127.0.0.1:{port}/v1/session"
        result["verify_direct"] = measure_verify(url, args.tokens, args.sessions)

    ray.init(
        num_cpus=2,
        include_dashboard=False,
        runtime_env={"env_vars": {"PYTHONPATH": ROOT, "OMP_WAIT_POLICY": "PASSIVE"}},
    )
    try:
        sport = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": sport})
        base = f"127.0.0.1:{sport}"
        echo: Deployment = serve.deployment(name="Echo", num_replicas=1)(serve.ingress(echo_app)())
        serve.run(echo.bind(), name="echo", route_prefix="/")
        result["echo_serve"] = measure_echo(f"http://{base}", f"ws://{base}", args.frames, args.reps)
        serve.delete("echo")

        fleet = fleet_args(build_parser().parse_args(["fleet", *VERIFIER_FLAGS]))
        assert isinstance(fleet, FleetArgs), fleet
        serve.run(build(fleet), name=APP_NAME, route_prefix="/")
        result["verify_serve"] = measure_verify(f"ws://{base}/v1/session", args.tokens, args.sessions)
    finally:
        shutdown: Callable[[], None] = serve.shutdown  # (untyped in Ray)
        shutdown()
        ray.shutdown()
    same = result["verify_direct"].pop("tokens") == result["verify_serve"].pop("tokens")
    result["verify_same_tokens"] = same
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
