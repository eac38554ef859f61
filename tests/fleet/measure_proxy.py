"""What Ray Serve's proxy adds to a WebSocket round trip: the same app connected to directly
(uvicorn on loopback) and through Serve's proxy (one replica, same machine).

    python -m tests.fleet.measure_proxy [--frames 200] [--tokens 48] [--sessions 3]

Three measurements, each direct and through the proxy: a WebSocket echo of small frames (the
proxy alone), real verify rounds of greedy sessions on the tiny model (the verifier's app as
`cloud-verifier serve` and as a fleet replica run it), and GET /healthz. Prints one JSON object:
medians and 90th percentiles in milliseconds.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import uvicorn
from websockets.sync.client import connect

from tests.cloud_verifier.service import LiveServer, prompt_tokens, tiny
from tests.fleet.echo import echo_app
from tests.fleet.wsclient import greedy_session

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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
    rounds, totals, outs = [], [], []
    for i in range(sessions):
        t = time.perf_counter()
        out, times = greedy_session(url, prompt_tokens(100 + i), tokens, seed=i)
        totals.append(time.perf_counter() - t)
        rounds.extend(times[1:])  # the prompt's round carries the prefill
        outs.append(out)
    return {"round": summary(rounds), "session": summary(totals), "tokens": outs}


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

    from cloud_verifier.fleet.app import build
    from cloud_verifier.fleet.config import APP_NAME, FleetArgs

    result: dict[str, Any] = {}
    # direct: the echo app on uvicorn in a thread
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(echo_app(), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    result["echo_direct"] = measure_echo(
        f"http://127.0.0.1:{port}", f"ws://127.0.0.1:{port}", args.frames, args.reps
    )
    server.should_exit = True
    thread.join()

    # direct: the verifier on uvicorn (as `cloud-verifier serve` runs it)
    tiny()
    with LiveServer(threads=1) as srv:
        result["verify_direct"] = measure_verify(srv.url, args.tokens, args.sessions)

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

        fleet = FleetArgs(
            model="tiny",
            max_sessions_per_replica=8,
            overrides={"measure_cost": False, "max_context": 512, "kv_blocks": 2048, "threads": 1},
        )
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
