"""The fleet autoscaling under a rising request rate, and back down after it: replicas, open sessions
and latency over time.

    python -m bench fleet_autoscale --rates 0.5,1,2,4 --step-seconds 30 --plot autoscale.png --json out.json

A fleet of the tiny verifier (`--model`) autoscales between `--min-replicas` and `--max-replicas`
on a local Ray cluster started here (`cloud-verifier fleet`'s flags: `--max-sessions` per replica,
`--upscale-delay`, `--downscale-delay`; each replica one thread). Requests arrive open loop, their
gaps exponential (seeded), at each rate of `--rates` for `--step-seconds`, then stop. A request is
one session through the fleet's address: hello, an `ar` prompt of `--tokens` new tokens, its
verdicts until done (a raw protocol client: no drafting model, so the load costs the client little
on a machine whose cores the replicas share). Twice a second the bench reads the fleet's replicas
(running, as Serve reports them) and the sessions and engine queues they report (`fleet status`).
After the load it waits (at most `--cool-seconds`) until the fleet is back at `--min-replicas`.

A session past every replica's cap is refused with 1013 "try again later"; the request tries again
a second later, as a client that honours it does (its wait counts in its latency).

Reported: per rate step the requests, failed ones (a session dropped or in error: a replica
stopped under it would show here), refusals, the end-to-end latency and ms per token (p50, p90)
and the most replicas running; the most replicas reached, the seconds from the load's start to the
first added replica and from the load's end to the fleet back at its minimum. `--plot`
draws replicas and the request rate, sessions, and each request's latency against time.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from bench.lib import runner
from bench.lib.args import add_common_args
from bench.lib.ray_fleet import LocalFleet, add_autoscale_args, autoscaled_fleet, ray_missing
from bench.lib.runner import Result, UsageError
from bench.lib.stats import median


def _rates(text: str) -> list[float]:
    try:
        out = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated request rates, got {text!r}") from None
    if not out or any(not 0 < r <= 1000 for r in out):
        raise argparse.ArgumentTypeError(f"expected rates in (0, 1000] requests per second, got {text!r}")
    return out


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default="tiny", help="the replicas' target (a model store name)")
    ap.add_argument(
        "--rates", type=_rates, default=[0.5, 1.0, 2.0, 4.0], help="request rates (req/s), rising"
    )
    ap.add_argument("--step-seconds", type=float, default=30.0, help="seconds at each rate")
    add_autoscale_args(ap)
    ap.add_argument(
        "--direct",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the replicas offer their own addresses (cloud-verifier fleet's default; this bench's "
        "raw clients do not move, so only the replicas' listeners differ)",
    )
    ap.add_argument("--cool-seconds", type=float, default=180.0, help="the most seconds to wait, after the "
                    "load, for the fleet to shrink back to --min-replicas")  # fmt: skip
    ap.add_argument(
        "--plot", type=Path, default=None, help="a PNG of replicas, sessions and latency over time"
    )
    add_common_args(
        ap,
        json=True,
        json_help="rows: one per rate step; `timeline` (the fleet twice a second) and `requests` (each one)",
        seed=0,
        seed_help="arrival times and prompts",
        tokens=192,
        tokens_help="new tokens per request (an ar session)",
        no_progress=True,
    )


def arrivals(rates: Sequence[float], step_s: float, rng: random.Random) -> list[tuple[float, float]]:
    """(seconds from the start, rate) of each request: Poisson arrivals at each rate for `step_s`."""
    out: list[tuple[float, float]] = []
    for i, rate in enumerate(rates):
        t, end = i * step_s, (i + 1) * step_s
        while True:
            t += rng.expovariate(rate)
            if t >= end:
                break
            out.append((t, rate))
    return out


def _binary(data: str | bytes) -> bytes:
    if isinstance(data, str):
        raise RuntimeError("the server sent a text frame; the protocol is binary")
    return data


class TryAgain(Exception):
    """The fleet refused a session with 1013 (every replica at its session cap)."""


async def _session(url: str, fingerprint: str, prompt: list[int], n: int) -> int:
    """One `ar` session of `n` tokens; its tokens. TryAgain when the fleet refuses it (1013)."""
    from websockets.asyncio.client import connect
    from websockets.exceptions import ConnectionClosed

    from shared.messages import Hello, Mode, Prompt, Verdict, Welcome
    from shared.protocol import ClientProtocol

    tokens = 0
    async with connect(url, max_size=None, open_timeout=60) as ws:
        proto = ClientProtocol()
        await ws.send(proto.hello(Hello(vocab_fingerprint=fingerprint)))
        try:
            welcome = proto.receive(_binary(await ws.recv()))
        except ConnectionClosed as exc:
            if exc.rcvd is not None and exc.rcvd.code == 1013:
                raise TryAgain(exc.rcvd.reason) from None
            raise
        if not isinstance(welcome, Welcome):
            raise RuntimeError("the hello was not answered with a welcome")
        await ws.send(proto.prompt(Prompt(tokens=np.array(prompt), mode=Mode.AR, max_new_tokens=n)))
        while True:
            msg = proto.receive(_binary(await asyncio.wait_for(ws.recv(), 120)))
            if isinstance(msg, Verdict):
                tokens += len(msg.tokens)
                if msg.done:
                    return tokens
            elif msg.TYPE.value == "error":
                raise RuntimeError(f"error frame: {msg}")


async def _request(url: str, fingerprint: str, prompt: list[int], n: int) -> dict[str, Any]:
    """One request as a client that honours "try again later" makes it: its session, tried again
    a second after each refusal (for at most 120 s); its end-to-end seconds (refusals included),
    the tokens, the refusals and what went wrong (None: nothing)."""
    t0 = time.perf_counter()
    refusals = 0
    error: str | None = None
    tokens = 0
    while True:
        try:
            tokens = await _session(url, fingerprint, prompt, n)
        except TryAgain:
            refusals += 1
            if time.perf_counter() - t0 < 120:
                await asyncio.sleep(1.0)
                continue
            error = "refused for 120 s"
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
        break
    return {"seconds": time.perf_counter() - t0, "tokens": tokens, "refusals": refusals, "error": error}


async def _sample(timeline: list[dict[str, Any]], t0: float, stop: asyncio.Event) -> None:
    """The fleet twice a second until `stop`: running replicas, sessions and queue they report."""
    from cloud_verifier.fleet.status import fleet_status

    while not stop.is_set():
        rows = await asyncio.to_thread(fleet_status)
        running = [r for r in rows if r["state"] == "RUNNING"]
        timeline.append(
            {
                "t": round(time.perf_counter() - t0, 2),
                "replicas": len(running),
                "starting": sum(1 for r in rows if r["state"] in ("STARTING", "PENDING_MIGRATION")),
                "sessions": sum(r["sessions"] or 0 for r in running),
                "queue": sum(r["queue"] or 0 for r in running),
            }
        )
        await asyncio.wait([asyncio.ensure_future(stop.wait())], timeout=0.5)


async def _drive(a: argparse.Namespace, url: str, fingerprint: str, vocab: int) -> dict[str, Any]:
    """The load, the samples and the cool-down; every request's record and the timeline."""
    rng = random.Random(a.seed)
    plan = arrivals(a.rates, a.step_seconds, rng)
    timeline: list[dict[str, Any]] = []
    requests: list[dict[str, Any]] = []
    stop = asyncio.Event()
    t0 = time.perf_counter()
    sampler = asyncio.create_task(_sample(timeline, t0, stop))
    bar = tqdm(total=len(plan), desc="fleet autoscale requests", file=sys.stderr, disable=a.no_progress)

    async def one(at: float, rate: float) -> None:
        await asyncio.sleep(max(0.0, at - (time.perf_counter() - t0)))
        prompt = [rng.randrange(3, vocab) for _ in range(16)]
        start = time.perf_counter() - t0
        rec = await _request(url, fingerprint, prompt, a.tokens)
        requests.append({"start": round(start, 3), "rate": rate, **rec})
        bar.update(1)

    await asyncio.gather(*(one(at, rate) for at, rate in plan))
    bar.close()
    load_end = time.perf_counter() - t0
    deadline = time.perf_counter() + a.cool_seconds
    while time.perf_counter() < deadline:  # back to the minimum, twice in a row
        if len(timeline) >= 2 and all(s["replicas"] == a.min_replicas for s in timeline[-2:]):
            break
        await asyncio.sleep(0.5)
    stop.set()
    await sampler
    requests.sort(key=lambda r: r["start"])
    return {"timeline": timeline, "requests": requests, "load_end": load_end}


def _pct(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)), 1) if values else None


def summarize(a: argparse.Namespace, run: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Rows per rate step and the run's figures."""
    timeline, requests, load_end = run["timeline"], run["requests"], run["load_end"]
    rows = []
    for i, rate in enumerate(a.rates):
        lo, hi = i * a.step_seconds, (i + 1) * a.step_seconds
        mine = [r for r in requests if r["rate"] == rate]
        ok = [r for r in mine if r["error"] is None]
        e2e = [r["seconds"] * 1e3 for r in ok]
        per_token = [r["seconds"] * 1e3 / r["tokens"] for r in ok if r["tokens"]]
        rows.append(
            {
                "rate": rate,
                "requests": len(mine),
                "failed": len(mine) - len(ok),
                "refusals": sum(r["refusals"] for r in mine),
                "e2e_ms_p50": _pct(e2e, 50),
                "e2e_ms_p90": _pct(e2e, 90),
                "ms_per_token_p50": _pct(per_token, 50),
                "ms_per_token_p90": _pct(per_token, 90),
                "replicas_max": max((s["replicas"] for s in timeline if lo <= s["t"] < hi), default=None),
            }
        )
    first_up = next((s["t"] for s in timeline if s["replicas"] > a.min_replicas), None)
    back = next((s["t"] for s in timeline if s["t"] >= load_end and s["replicas"] == a.min_replicas), None)
    figures = {
        "replicas_max": max((s["replicas"] for s in timeline), default=0),
        "first_scale_up_s": first_up,
        "back_to_min_s_after_load": round(back - load_end, 1) if back is not None else None,
        "requests": len(requests),
        "failed": sum(1 for r in requests if r["error"] is not None),
        "refusals": sum(r["refusals"] for r in requests),
        "e2e_ms_median": median([r["seconds"] * 1e3 for r in requests if r["error"] is None], 1),
    }
    return rows, figures


def plot(a: argparse.Namespace, run: dict[str, Any], path: Path) -> None:
    """Replicas (and the request rate), sessions, and each request's latency against time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from bench.harness import save_figure

    tl, req = run["timeline"], run["requests"]
    fig, (rep, ses, lat) = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
    t = [s["t"] for s in tl]
    rep.step(t, [s["replicas"] for s in tl], where="post", label="replicas running")
    rep.set_ylabel("replicas")
    rep.set_ylim(0, a.max_replicas + 0.5)
    rate = rep.twinx()
    edges = [i * a.step_seconds for i in range(len(a.rates) + 1)]
    rate.step(edges, [*a.rates, 0.0], where="post", color="C1", alpha=0.6, label="request rate")
    rate.set_ylabel("requests / s", color="C1")
    ses.plot(t, [s["sessions"] for s in tl], label="open sessions (all replicas)")
    ses.plot(t, [s["queue"] for s in tl], label="engine queues", alpha=0.7)
    ses.axhline(a.max_sessions * 0.75, color="grey", ls=":", label="autoscaling target per replica")
    ses.set_ylabel("sessions")
    ses.legend(fontsize=8)
    ok = [r for r in req if r["error"] is None and r["tokens"]]
    lat.scatter([r["start"] + r["seconds"] for r in ok], [r["seconds"] * 1e3 / r["tokens"] for r in ok], s=8)
    bad = [r for r in req if r["error"] is not None]
    if bad:
        lat.scatter([r["start"] for r in bad], [0] * len(bad), marker="x", color="red", label="failed")
        lat.legend(fontsize=8)
    lat.set_ylabel("ms per token (each request, at its end)")
    lat.set_xlabel("seconds")
    for ax in (rep, ses, lat):
        ax.axvline(run["load_end"], color="grey", ls="--", lw=0.8)
    fig.suptitle(
        f"fleet autoscaling {a.min_replicas}-{a.max_replicas} replicas of {a.model}, "
        f"{a.max_sessions} sessions each (delays {a.upscale_delay:g}/{a.downscale_delay:g} s)",
        fontsize=10,
    )
    save_figure(fig, path, dpi=120)


def run(a: argparse.Namespace) -> Result:

    why = ray_missing()
    if why:
        raise UsageError(why)
    if not 1 <= a.min_replicas < a.max_replicas:
        raise UsageError("--min-replicas must be at least 1 and below --max-replicas")
    if a.step_seconds <= 0 or a.max_sessions < 1 or a.tokens < 1:
        raise UsageError("--step-seconds > 0, --max-sessions >= 1 and --tokens >= 1")
    from cloud_verifier.fleet.app import build
    from cloud_verifier.fleet.config import APP_NAME
    from shared.model import load_target

    try:
        fleet = autoscaled_fleet(a, a.direct)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    target = load_target(a.model, progress=not a.no_progress)
    fingerprint, vocab = target.vocab_fingerprint, int(target.config.vocab_size)
    del target
    from ray import serve

    with LocalFleet(num_cpus=a.max_replicas) as local:
        serve.run(build(fleet), name=APP_NAME, route_prefix="/")
        result = asyncio.run(_drive(a, local.url, fingerprint, vocab))
    rows, figures = summarize(a, result)
    cols = ["rate", "requests", "failed", "refusals", "e2e_ms_p50", "e2e_ms_p90", "ms_per_token_p50"]
    cols.append("replicas_max")
    from bench.harness import table

    text = table([[r[c] for c in cols] for r in rows], cols)
    text += "\n" + "\n".join(f"{k}: {v}" for k, v in figures.items())
    return Result(
        rows,
        text,
        extra={**figures, "timeline": result["timeline"], "requests": result["requests"]},
        plot=(lambda path: plot(a, result, path)) if a.plot else None,
        status=0 if figures["failed"] == 0 else 1,
    )


def main(argv: Sequence[str] | None = None) -> int:
    return runner.main(__name__, argv)


if __name__ == "__main__":
    sys.exit(main())
