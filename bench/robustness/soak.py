"""Soak a live verifier: many clients for minutes, a share of them cancelling or dropping mid-round.

    python -m bench soak --clients 16 --minutes 10 --json bench/out/soak.json

Starts `cloud-verifier serve --model tiny` in its own process (or `--url`, with `--pid` for its
memory). Each client loops: open a session, prompt (greedy, random tokens), send small trees round
after round; with probability `--drop` a generation is cancelled or the socket is dropped without a
close at a random round. After a warm-up (the first fifth of the time) the server's resident memory
is noted; at the end, once the clients are gone, the KV pool must be back to idle and the memory
within `--rss-tolerance` of the warm-up value, and an honest session must equal target-only `ar`.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import msgpack
from tqdm import tqdm

from bench.harness import Verifier, add_common_args, figure_rows, table
from bench.lib import runner
from bench.lib.frames import honest_generation, i32, recv
from bench.lib.runner import Result, UsageError


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def kv_blocks(http: str) -> float:
    for line in httpx.get(http + "/metrics", timeout=10).text.splitlines():
        if line.startswith("specdec_kv_blocks_in_use "):
            return float(line.split()[1])
    raise RuntimeError("no specdec_kv_blocks_in_use in /metrics")


def plateau(series: Sequence[tuple[float, float]], seconds: float) -> dict[str, float | None]:
    """Where the memory levels off: the growth over each half of the time after warm-up (the first
    fifth), from the median of the samples in the first and last tenth of each half. Growth that is
    still there in the second half is a leak; growth only in the first is a pool filling up."""

    def med(a: float, b: float) -> float | None:
        xs = sorted(mb for t, mb in series if a <= t <= b)
        return xs[len(xs) // 2] if xs else None

    w = seconds / 5
    mid = w + (seconds - w) / 2
    span = (seconds - w) / 20
    a0, a1, b1 = med(w, w + span), med(mid - span, mid + span), med(seconds - span, seconds)
    first = (a1 - a0) / a0 if a0 and a1 else None
    second = (b1 - a1) / a1 if a1 and b1 else None
    return {
        "rss_growth_first_half": None if first is None else round(first, 4),
        "rss_growth_second_half": None if second is None else round(second, 4),
    }


async def client(
    url: str, hello: bytes, rng: random.Random, drop: float, stop: float, tally: Counter[str]
) -> None:
    from websockets.asyncio.client import connect

    while time.monotonic() < stop:
        try:
            ws = await connect(url, max_size=None, open_timeout=10)
        except Exception:
            tally["connect_failed"] += 1
            await asyncio.sleep(0.5)
            continue
        aborted = False
        try:
            await ws.send(hello)
            if (await recv(ws, 30)).get("type") != "welcome":
                tally["refused"] += 1
                await asyncio.sleep(0.5)
                continue
            rnd = 0  # round ids increase over the whole session
            for _ in range(rng.randint(1, 3)):  # a few generations per session
                prompt = [rng.randrange(3, 49152) for _ in range(rng.randint(4, 48))]
                n = rng.randint(16, 96)
                await ws.send(
                    msgpack.packb(
                        {"type": "prompt", "tokens": i32(prompt), "mode": "greedy", "max_new_tokens": n}
                    )
                )
                quit_at = rng.randint(1, 6) if rng.random() < drop else -1
                how = rng.choice(["cancel", "drop"])
                committed, rounds = len(prompt), 0
                while True:
                    m = await recv(ws, 60)
                    if m.get("type") == "error":
                        tally[f"error_{m.get('code')}_{m.get('field')}"] += 1
                        if m.get("round") == 0 or m.get("fatal"):
                            break
                        continue
                    if m.get("type") != "verdict":
                        continue
                    committed = int(m["committed_len"])
                    if m["done"]:
                        tally["completed" if m.get("reason") != "cancelled" else "cancelled"] += 1
                        break
                    rounds += 1
                    if rounds == quit_at and how == "drop":
                        ws.transport.abort()  # gone without a close frame
                        tally["dropped"] += 1
                        aborted = True
                        break
                    if rounds == quit_at:  # cancel: the done verdict comes next, no more trees
                        await ws.send(msgpack.packb({"type": "cancel"}))
                        continue
                    rnd += 1
                    toks = [rng.randrange(3, 49152) for _ in range(rng.randint(1, 6))]
                    chain = i32(list(range(-1, len(toks) - 1)))
                    tree = {
                        "type": "tree",
                        "round": rnd,
                        "base": committed,
                        "cond": b"",
                        "tokens": i32(toks),
                    }
                    tree["parents"] = chain
                    await ws.send(msgpack.packb(tree))
                if aborted:
                    break
        except Exception as exc:
            if not aborted:
                tally[f"closed_{getattr(getattr(exc, 'rcvd', None), 'code', 0)}"] += 1
        finally:
            if not aborted:
                await ws.close()


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--clients", type=int, default=16, help="concurrent clients")
    ap.add_argument("--minutes", type=float, default=10.0, help="how long the clients run")
    ap.add_argument("--drop", type=float, default=0.3, help="share of generations cancelled or dropped")
    ap.add_argument("--rss-tolerance", type=float, default=0.10, help="allowed RSS growth after warm-up")
    ap.add_argument("--url", default=None, help="soak a running verifier instead of starting one")
    ap.add_argument("--pid", type=int, default=None, help="with --url: the verifier's process id (memory)")
    ap.add_argument(
        "--sample-every",
        type=float,
        default=10.0,
        help="seconds between samples of the verifier's resident memory (the JSON's rss_series)",
    )
    add_common_args(
        ap,
        json=True,
        json_help="the figures (rows: one {figure, value} each), rss_series and ok",
        seed=0,
        seed_help="randomness of the clients",
        no_progress=True,
    )


def tiny_hello() -> bytes:
    """The hello frame of a client of the tiny model (its vocabulary's fingerprint)."""
    from shared.model import load_target

    hello: bytes = msgpack.packb(
        {
            "type": "hello",
            "version": 1,
            "vocab_fingerprint": load_target("tiny", progress=False).vocab_fingerprint,
        }
    )
    return hello


async def soak(
    url: str,
    hello: bytes,
    pid: int | None,
    seconds: float,
    tally: Counter[str],
    series: list[tuple[float, float]],
    *,
    clients: int,
    seed: int,
    drop: float,
    sample_every: float,
    progress: bool,
) -> tuple[float | None, list[int], list[int]]:
    """`clients` clients for `seconds` (the verifier's RSS, with a `pid`, sampled into `series`
    every `sample_every` seconds and noted once after the warm-up), then an honest session and its
    `ar` run: (the warm-up RSS, the honest tokens, ar's tokens)."""
    t0 = time.monotonic()
    stop = t0 + seconds
    tasks = [
        asyncio.create_task(client(url, hello, random.Random(seed * 1000 + i), drop, stop, tally))
        for i in range(clients)
    ]
    warm: float | None = None
    next_sample = t0
    with tqdm(
        total=int(seconds), desc="soak seconds", file=sys.stderr, mininterval=5, disable=not progress
    ) as bar:
        while any(not t.done() for t in tasks):
            await asyncio.sleep(1)
            bar.n = min(int(time.monotonic() - t0), int(seconds))
            bar.refresh()
            now = time.monotonic()
            if pid and now >= next_sample:
                series.append((round(now - t0, 1), round(rss_mb(pid), 1)))
                next_sample += sample_every
            if warm is None and pid and now - t0 >= seconds / 5:
                warm = rss_mb(pid)
    await asyncio.gather(*tasks)
    honest, ar = await honest_generation(url, hello, [5, 6, 7, 8, 9], 24)
    return warm, honest, ar


def kv_settled(http: str, kv_idle: float) -> float:
    """The KV blocks in use once they are back to `kv_idle`, or after 10 s (dropped sockets are
    noticed within a round)."""
    deadline = time.monotonic() + 10
    while kv_blocks(http) > kv_idle and time.monotonic() < deadline:
        time.sleep(0.2)
    return kv_blocks(http)


def figures(
    *,
    clients: int,
    seconds: float,
    drop: float,
    tally: Counter[str],
    kv_idle: float,
    kv_end: float,
    warm: float | None,
    end: float | None,
    growth: float | None,
    honest_identical: bool,
    series: Sequence[tuple[float, float]],
) -> dict[str, Any]:
    """The printed table's figures: the run, the clients' tally, the KV blocks in use (idle
    before, after), the RSS (after the warm-up, at the end, its growth), whether the honest session
    equals `ar`, and where the memory levels off."""
    return {
        "clients": clients,
        "seconds": seconds,
        "drop": drop,
        **{k: tally[k] for k in sorted(tally)},
        "kv_blocks_idle_before": kv_idle,
        "kv_blocks_idle_after": kv_end,
        "rss_warm_mb": None if warm is None else round(warm, 1),
        "rss_end_mb": None if end is None else round(end, 1),
        "rss_growth": None if growth is None else round(growth, 4),
        "honest_identical_to_ar": honest_identical,
        **plateau(series, seconds),
    }


def run(a: argparse.Namespace) -> Result:
    if a.clients < 1 or a.minutes <= 0 or not 0 <= a.drop <= 1 or a.sample_every <= 0:
        raise UsageError("--clients >= 1, --minutes > 0, 0 <= --drop <= 1 and --sample-every > 0")
    verifier = None
    if a.url is None:
        verifier = Verifier(
            "tiny", threads=1, args=["--no-measure-cost", "--max-sessions", str(a.clients + 4)]
        ).start()
        url, pid = verifier.url, verifier.proc.pid if verifier.proc else None
    else:
        url, pid = a.url, a.pid
    http = url.replace("ws://", "http://").split("/v1/")[0]
    hello = tiny_hello()
    tally: Counter[str] = Counter()
    series: list[tuple[float, float]] = []  # (seconds since start, RSS MB) while the clients run
    kv_idle = kv_blocks(http)
    seconds = a.minutes * 60
    try:
        warm, honest, ar = asyncio.run(
            soak(
                url,
                hello,
                pid,
                seconds,
                tally,
                series,
                clients=a.clients,
                seed=a.seed,
                drop=a.drop,
                sample_every=a.sample_every,
                progress=not a.no_progress,
            )
        )
        kv_end = kv_settled(http, kv_idle)
        end = rss_mb(pid) if pid else None
    finally:
        if verifier is not None:
            verifier.stop()
    growth = (end - warm) / warm if warm and end else None
    result = figures(
        clients=a.clients,
        seconds=seconds,
        drop=a.drop,
        tally=tally,
        kv_idle=kv_idle,
        kv_end=kv_end,
        warm=warm,
        end=end,
        growth=growth,
        honest_identical=honest == ar,
        series=series,
    )
    text = table([[k, v] for k, v in result.items()], ["figure", "value"])
    rows = figure_rows(result)  # the table as printed (rss_series and ok join the file below)
    result["rss_series"] = series
    ok = kv_end <= kv_idle and (growth is None or growth <= a.rss_tolerance) and honest == ar
    result["ok"] = ok
    return Result(rows, f"{text}\nsoak: {'ok' if ok else 'FAILED'}", extra=result, status=0 if ok else 1)


def main(argv: Sequence[str] | None = None) -> int:
    return runner.main(__name__, argv)


if __name__ == "__main__":
    sys.exit(main())
